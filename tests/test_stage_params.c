/* epipe_stage_get_param: every knob epipe_stage_set_param() sets reads
 * back, with its default before any set, unchanged after a refused set,
 * and bad arguments are refused by name. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <epipe/epipe.h>

static int64_t get(const epipe_stage *st, epipe_stage_param p)
{
    int64_t v = -12345;
    assert_int_equal(epipe_stage_get_param(st, p, &v), EPIPE_OK);
    return v;
}

static void knobs_read_back(void **state)
{
    (void)state;
    epipe_comm *comms[2];
    epipe_stage *st;
    assert_int_equal(epipe_comm_create_inproc(comms, 2), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&st, comms[0], "1f1b", 4), EPIPE_OK);

    /* Defaults. */
    /* Unset, the stage's timeout is the communicator's, as it is now. */
    assert_int_equal(epipe_comm_set_param(comms[0], EPIPE_COMM_TIMEOUT_MS, 4321), EPIPE_OK);
    assert_int_equal(get(st, EPIPE_STAGE_TIMEOUT_MS), 4321);
    assert_int_equal(get(st, EPIPE_STAGE_CODEC_THREADS), 1);
    assert_int_equal(get(st, EPIPE_STAGE_BATCH_SIZE), 0);
    assert_int_equal(get(st, EPIPE_STAGE_TRAINING), 1);
    assert_int_equal(get(st, EPIPE_STAGE_CUDA_DEVICE), -1);

    /* What was set. */
    assert_int_equal(epipe_stage_set_param(st, EPIPE_STAGE_TIMEOUT_MS, 1234), EPIPE_OK);
    assert_int_equal(epipe_stage_set_param(st, EPIPE_STAGE_CODEC_THREADS, 3), EPIPE_OK);
    assert_int_equal(epipe_stage_set_param(st, EPIPE_STAGE_BATCH_SIZE, 32), EPIPE_OK);
    assert_int_equal(epipe_stage_set_param(st, EPIPE_STAGE_TRAINING, 0), EPIPE_OK);
    assert_int_equal(get(st, EPIPE_STAGE_TIMEOUT_MS), 1234);
    assert_int_equal(get(st, EPIPE_STAGE_CODEC_THREADS), 3);
    assert_int_equal(get(st, EPIPE_STAGE_BATCH_SIZE), 32);
    assert_int_equal(get(st, EPIPE_STAGE_TRAINING), 0);

    /* A refused set changes nothing. */
    assert_int_equal(epipe_stage_set_param(st, EPIPE_STAGE_TIMEOUT_MS, 0), EPIPE_EINVAL);
    assert_int_equal(epipe_stage_set_param(st, EPIPE_STAGE_BATCH_SIZE, 30), EPIPE_EINVAL);
    assert_int_equal(get(st, EPIPE_STAGE_TIMEOUT_MS), 1234);
    assert_int_equal(get(st, EPIPE_STAGE_BATCH_SIZE), 32);

    epipe_stage_destroy(st);
    epipe_comm_destroy(comms[0]);
    epipe_comm_destroy(comms[1]);
}

static void bad_arguments_are_refused(void **state)
{
    (void)state;
    epipe_comm *comms[2];
    epipe_stage *st;
    int64_t v = 77;
    assert_int_equal(epipe_comm_create_inproc(comms, 2), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&st, comms[1], "gpipe", 2), EPIPE_OK);
    assert_int_equal(epipe_stage_get_param(NULL, EPIPE_STAGE_TIMEOUT_MS, &v), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "stage is NULL"));
    assert_int_equal(epipe_stage_get_param(st, EPIPE_STAGE_TIMEOUT_MS, NULL), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "value is NULL"));
    assert_int_equal(epipe_stage_get_param(st, (epipe_stage_param)99, &v), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "unknown stage parameter 99"));
    assert_int_equal(v, 77);
    epipe_stage_destroy(st);
    epipe_comm_destroy(comms[0]);
    epipe_comm_destroy(comms[1]);
}

/* EPIPE_STAGE_CUDA_DEVICE: out of range is refused; a CUDA device where
 * the backend cannot run is refused as unsupported, naming what is missing
 * (the module here: the GPU machine's run checks the rest,
 * tests/gpu/test_gpu_stage.cu), and the knob stays at host memory. */
static void cuda_device_without_cuda(void **state)
{
    (void)state;
    epipe_comm *comms[2];
    epipe_stage *st;
    assert_int_equal(epipe_comm_create_inproc(comms, 2), EPIPE_OK);
    assert_int_equal(epipe_stage_create(&st, comms[1], "1f1b", 2), EPIPE_OK);
    assert_int_equal(epipe_stage_set_param(st, EPIPE_STAGE_CUDA_DEVICE, -2), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_stage_last_error(st), "EPIPE_STAGE_CUDA_DEVICE = -2"));
    setenv("EPIPE_CUDA_MODULE", "/nonexistent/libepipe-cuda.so", 1);
    assert_int_equal(epipe_stage_set_param(st, EPIPE_STAGE_CUDA_DEVICE, 0), EPIPE_ENOTSUP);
    assert_non_null(strstr(epipe_stage_last_error(st), "/nonexistent/libepipe-cuda.so"));
    assert_non_null(strstr(epipe_stage_last_error(st), "no module"));
    unsetenv("EPIPE_CUDA_MODULE");
    assert_int_equal(get(st, EPIPE_STAGE_CUDA_DEVICE), -1);
    assert_int_equal(epipe_stage_set_param(st, EPIPE_STAGE_CUDA_DEVICE, -1), EPIPE_OK);
    epipe_stage_destroy(st);
    epipe_comm_destroy(comms[0]);
    epipe_comm_destroy(comms[1]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(knobs_read_back),
        cmocka_unit_test(bad_arguments_are_refused),
        cmocka_unit_test(cuda_device_without_cuda),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
