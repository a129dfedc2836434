/* The blas build feature: with it, poweriter and insert are ordinary codecs;
 * without it they stay registered and refuse to be created, naming the
 * missing library, while their specs still parse as elsewhere. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include <epipe/epipe.h>

static const char *const blas_specs[] = {
    "poweriter:rank=2",
    "poweriter:rank=3,iters=2,warm=0,factors=fp16",
    "insert:kind=linear,out=4",
    "insert:kind=conv,ratio=0.5,kernel=2,in=3,seed=7,code=fp16",
    "insert:kind=linear,out=2|quant:bits=5",
};

static void blas_codecs_follow_the_feature(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof blas_specs / sizeof blas_specs[0]; i++) {
        epipe_codec *c = NULL;
        int rc = epipe_codec_create(&c, blas_specs[i]);
#ifdef EPIPE_HAVE_BLAS
        if (rc != EPIPE_OK)
            fail_msg("%s: %s", blas_specs[i], epipe_last_error());
        assert_non_null(c);
        epipe_codec_destroy(c);
#else
        assert_int_equal(rc, EPIPE_ENOTSUP);
        assert_null(c);
        const char *msg = epipe_last_error();
        assert_non_null(strstr(msg, "OpenBLAS/LAPACKE"));
        assert_non_null(strstr(msg, blas_specs[i][0] == 'p' ? "poweriter" : "insert"));
#endif
    }
}

/* Bad specs fail as they do with the feature: a wrong key is EINVAL, not
 * ENOTSUP, so a typo is never reported as a missing library. */
static void bad_specs_are_still_einval(void **state)
{
    (void)state;
    epipe_codec *c = NULL;
    assert_int_equal(epipe_codec_create(&c, "poweriter:rnak=2"), EPIPE_EINVAL);
    assert_non_null(strstr(epipe_last_error(), "rnak"));
    assert_int_equal(epipe_codec_create(&c, "insert:kind=square"), EPIPE_EINVAL);
    assert_int_equal(epipe_codec_create(&c, "poweriter:rank=0"), EPIPE_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(blas_codecs_follow_the_feature),
        cmocka_unit_test(bad_specs_are_still_einval),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
