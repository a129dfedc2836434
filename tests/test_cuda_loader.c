/* The CUDA backend's loader and API on any machine: a CUDA tensor without
 * module, driver or device gets EPIPE_ENOTSUP naming what is missing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <epipe/epipe.h>

static float cpu_x[64], cpu_y[64];
static int64_t shape[1] = {64};

static DLTensor tensor(int device_type, void *data)
{
    DLTensor t = {0};
    t.data = data;
    t.device.device_type = (DLDeviceType)device_type;
    t.ndim = 1;
    t.shape = shape;
    t.dtype.code = kDLFloat;
    t.dtype.bits = 32;
    t.dtype.lanes = 1;
    return t;
}

/* Any non-NULL address: the loader refuses before reading it. */
static char fake_device_memory[256];

static void test_missing_module_names_path(void **state)
{
    (void)state;
    setenv("EPIPE_CUDA_MODULE", "/nonexistent/libepipe-cuda.so", 1);
    epipe_codec *c;
    assert_int_equal(epipe_codec_create(&c, "quant:bits=8"), EPIPE_OK);
    DLTensor src = tensor(kDLCUDA, fake_device_memory);
    uint8_t buf[256];
    size_t w = 99;
    assert_int_equal(epipe_codec_encode(c, &src, buf, sizeof buf, &w), EPIPE_ENOTSUP);
    assert_int_equal(w, 0);
    assert_non_null(strstr(epipe_codec_last_error(c), "/nonexistent/libepipe-cuda.so"));
    assert_non_null(strstr(epipe_codec_last_error(c), "no module"));
    DLTensor dst = tensor(kDLCUDAManaged, fake_device_memory);
    assert_int_equal(epipe_codec_decode(c, buf, sizeof buf, &dst), EPIPE_ENOTSUP);
    assert_non_null(strstr(epipe_last_error(), "dst is a CUDA tensor"));
    epipe_codec_destroy(c);
}

/* The built module loads; without a driver (this CI) or a device the probe
 * refuses. Where a GPU exists the probe passes: the gpu suite covers it. */
static void test_module_without_device(void **state)
{
    (void)state;
    const char *mod = getenv("EPIPE_TEST_CUDA_MODULE");
    if (!mod || !*mod)
        skip();
    setenv("EPIPE_CUDA_MODULE", mod, 1);
    epipe_codec *c;
    assert_int_equal(epipe_codec_create(&c, "none"), EPIPE_OK);
    DLTensor src = tensor(kDLCUDA, fake_device_memory);
    uint8_t buf[512];
    size_t w;
    int rc = epipe_codec_encode(c, &src, buf, sizeof buf, &w);
    const char *msg = epipe_codec_last_error(c);
    if (rc == EPIPE_ENOTSUP && (strstr(msg, "no CUDA driver") || strstr(msg, "no CUDA device") ||
                                strstr(msg, "no usable CUDA device"))) {
        assert_non_null(strstr(msg, "src is a CUDA tensor"));
        /* The module stays loaded; asking again gives the same answer. */
        assert_int_equal(epipe_codec_encode(c, &src, buf, sizeof buf, &w), EPIPE_ENOTSUP);
        assert_int_equal(epipe_codec_synchronize(c), EPIPE_OK); /* nothing was enqueued */
    } else {
        /* A GPU is present: the fake pointer is not device memory. */
        assert_int_equal(rc, EPIPE_EINVAL);
        assert_non_null(strstr(msg, "not CUDA device memory"));
    }
    /* Once loaded, the module stays: the variable is no longer read, so
     * naming another path changes nothing. */
    char first[512];
    snprintf(first, sizeof first, "%s", msg);
    setenv("EPIPE_CUDA_MODULE", "/nonexistent/libepipe-cuda.so", 1);
    assert_int_equal(epipe_codec_encode(c, &src, buf, sizeof buf, &w), rc);
    assert_string_equal(epipe_codec_last_error(c), first);
    assert_null(strstr(epipe_codec_last_error(c), "nonexistent"));
    setenv("EPIPE_CUDA_MODULE", mod, 1);
    epipe_codec_destroy(c);
    /* A codec without kernels is refused by name where a device exists,
     * by the missing device elsewhere: ENOTSUP either way. */
    assert_int_equal(epipe_codec_create(&c, "topk:ratio=0.1"), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(c, &src, buf, sizeof buf, &w), EPIPE_ENOTSUP);
    epipe_codec_destroy(c);
}

/* The CPU backend stores and ignores the stream; synchronize is a no-op. */
static void test_cpu_stream_calls(void **state)
{
    (void)state;
    epipe_codec *c;
    assert_int_equal(epipe_codec_create(&c, "quant:bits=8"), EPIPE_OK);
    assert_int_equal(epipe_codec_set_stream(c, (void *)0x1234), EPIPE_OK);
    assert_int_equal(epipe_codec_synchronize(c), EPIPE_OK);
    for (int i = 0; i < 64; i++)
        cpu_x[i] = (float)i * 0.25f - 3.0f;
    DLTensor src = tensor(kDLCPU, cpu_x), dst = tensor(kDLCPU, cpu_y);
    uint8_t buf[256];
    size_t w;
    assert_int_equal(epipe_codec_encode(c, &src, buf, sizeof buf, &w), EPIPE_OK);
    assert_int_equal(epipe_codec_synchronize(c), EPIPE_OK);
    assert_int_equal(epipe_codec_decode(c, buf, w, &dst), EPIPE_OK);
    assert_int_equal(epipe_codec_set_stream(c, NULL), EPIPE_OK);
    epipe_codec_destroy(c);
    assert_int_equal(epipe_codec_set_stream(NULL, NULL), EPIPE_EINVAL);
    assert_int_equal(epipe_codec_synchronize(NULL), EPIPE_EINVAL);
}

/* A handle bound to the CPU by its first tensor refuses a CUDA tensor by
 * both devices, before any module is looked for. */
static void test_binding_mixup(void **state)
{
    (void)state;
    setenv("EPIPE_CUDA_MODULE", "/nonexistent/libepipe-cuda.so", 1);
    epipe_codec *c;
    assert_int_equal(epipe_codec_create(&c, "none"), EPIPE_OK);
    DLTensor src = tensor(kDLCPU, cpu_x), gpu = tensor(kDLCUDA, fake_device_memory);
    uint8_t buf[512];
    size_t w;
    assert_int_equal(epipe_codec_encode(c, &src, buf, sizeof buf, &w), EPIPE_OK);
    assert_int_equal(epipe_codec_encode(c, &gpu, buf, sizeof buf, &w), EPIPE_EINVAL);
    const char *msg = epipe_codec_last_error(c);
    assert_non_null(strstr(msg, "CUDA tensor (device 0)"));
    assert_non_null(strstr(msg, "bound to CPU"));
    assert_int_equal(epipe_codec_decode(c, buf, 16 + 64 * 4, &gpu), EPIPE_EINVAL);
    /* pinned host memory is host memory: same binding as kDLCPU */
    DLTensor pinned = tensor(kDLCUDAHost, cpu_y);
    assert_int_equal(epipe_codec_decode(c, buf, 16 + 64 * 4, &pinned), EPIPE_OK);
    assert_memory_equal(cpu_x, cpu_y, sizeof cpu_x);
    epipe_codec_destroy(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_missing_module_names_path),
        cmocka_unit_test(test_module_without_device),
        cmocka_unit_test(test_cpu_stream_calls),
        cmocka_unit_test(test_binding_mixup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
