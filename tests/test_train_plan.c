/* epipe-train's plan files (examples/train/plan_file.c): what the writer
 * writes parses back to the same plan, and every malformed file is refused
 * with a message naming its line and what is wrong. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../examples/train/plan_file.h"

static const char good[] = "epipe-train-plan 1\n"
                           "# a comment, then a blank line\n"
                           "\n"
                           "layers 4\n"
                           "stages 3\n"
                           "schedule 1f1b\n"
                           "split 0 2 3\n"
                           "act 0 sortquant:bits=8,zero=1\n"
                           "grad 0 quant:bits=4,zero=1,ef=1\n"
                           "act 1 none\n"
                           "grad  1\tnone\n";

static void round_trip(void **state)
{
    (void)state;
    struct train_plan p, q;
    char err[300] = "";
    assert_int_equal(train_plan_parse(good, sizeof good - 1, &p, err, sizeof err), 0);
    assert_int_equal(p.layers, 4);
    assert_int_equal(p.stages, 3);
    assert_string_equal(p.schedule, "1f1b");
    assert_int_equal(p.first[0], 0);
    assert_int_equal(p.first[1], 2);
    assert_int_equal(p.first[2], 3);
    assert_int_equal(p.first[3], 4);
    assert_string_equal(p.act[0], "sortquant:bits=8,zero=1");
    assert_string_equal(p.grad[0], "quant:bits=4,zero=1,ef=1");
    assert_string_equal(p.grad[1], "none");
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_int_equal(train_plan_write(f, &p), 0);
    fclose(f);
    assert_int_equal(train_plan_parse(buf, len, &q, err, sizeof err), 0);
    assert_memory_equal(&p, &q, sizeof p);
    free(buf);
    /* CRLF line ends and no final newline */
    const char crlf[] = "epipe-train-plan 1\r\nlayers 1\r\nstages 1\r\nschedule gpipe\r\nsplit 0";
    assert_int_equal(train_plan_parse(crlf, sizeof crlf - 1, &p, err, sizeof err), 0);
    assert_int_equal(p.first[1], 1);
}

static void expect_refused(const char *text, const char *needle)
{
    struct train_plan p;
    char err[300] = "";
    if (train_plan_parse(text, strlen(text), &p, err, sizeof err) != -1 || !strstr(err, needle))
        fail_msg("'%s': expected an error naming '%s', got '%s'", text, needle, err);
}

#define HEAD "epipe-train-plan 1\nlayers 3\nstages 3\nschedule 1f1b\n"
#define CODECS "act 0 none\ngrad 0 none\nact 1 none\ngrad 1 none\n"

static void malformed(void **state)
{
    (void)state;
    expect_refused("", "empty");
    expect_refused("layers 3\n", "line 1: the first line must be");
    expect_refused("epipe-train-plan 2\n", "first line");
    expect_refused(HEAD "split 0 1 2\n" CODECS "colour blue\n",
                   "line 10: unknown keyword 'colour'");
    expect_refused(HEAD "layers 3\n", "line 5: 'layers' is given twice");
    expect_refused("epipe-train-plan 1\nlayers 0\n", "count in 1..64");
    expect_refused("epipe-train-plan 1\nlayers 65\n", "count in 1..64");
    expect_refused("epipe-train-plan 1\nlayers -1\n", "count in 1..64");
    expect_refused("epipe-train-plan 1\nlayers 3x\n", "count in 1..64");
    expect_refused("epipe-train-plan 1\nlayers 3 4\n", "unexpected text");
    expect_refused("epipe-train-plan 1\nlayers 2\nstages 3\nsplit 0 1 2\n", "at least as many");
    expect_refused(HEAD "split 1 2 2\n", "'split' needs 3 first layers");
    expect_refused(HEAD "split 0 2 1\n", "increasing");
    expect_refused(HEAD "split 0 1 3\n", "each below 3");
    expect_refused(HEAD "split 0 1\n", "'split' needs 3");
    expect_refused(HEAD "split 0 1 2 2\n", "unexpected text");
    expect_refused("epipe-train-plan 1\nsplit 0\n", "after 'layers' and 'stages'");
    expect_refused(HEAD "split 0 1 2\nact 2 none\n", "boundary in 0..1");
    expect_refused("epipe-train-plan 1\nstages 1\nact 0 none\n", "no boundaries");
    expect_refused(HEAD "split 0 1 2\nact 0\n", "needs a codec spec");
    expect_refused(HEAD "split 0 1 2\nact 0 none\nact 0 none\n", "'act 0' is given twice");
    expect_refused(HEAD "split 0 1 2\nact 0 none none\n", "unexpected text");
    expect_refused(HEAD "split 0 1 2\nact 0 none\ngrad 0 none\nact 1 none\n", "no 'grad 1' line");
    expect_refused(HEAD "split 0 1 2\n", "no 'act 0' line");
    expect_refused("epipe-train-plan 1\nlayers 3\nstages 3\nsplit 0 1 2\n", "no 'schedule'");
    expect_refused(HEAD CODECS, "no 'split'");
    expect_refused("epipe-train-plan 1\nschedule 1F1B\n", "lower-case");
    expect_refused("epipe-train-plan 1\nschedule aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\n", "1..31");
    expect_refused("epipe-train-plan 1\nlayers\x01 3\n", "line 2: byte 0x01");
    expect_refused("epipe-train-plan 1\nlayers \xc3\xa9\n", "byte 0xc3");
    /* a spec at the limit and one past it; a line past 512 characters */
    char text[1200];
    char spec[300];
    memset(spec, 'a', sizeof spec);
    spec[256] = '\0';
    snprintf(text, sizeof text, HEAD "split 0 1 2\nact 0 %s\n", spec);
    expect_refused(text, "1..255 characters");
    memset(spec, 'a', 300);
    char line[600];
    memset(line, '#', sizeof line - 1);
    line[sizeof line - 1] = '\0';
    snprintf(text, sizeof text, "epipe-train-plan 1\n%s\n", line);
    expect_refused(text, "line 2: longer than 512");
    /* a NUL inside the text */
    struct train_plan p;
    char err[300];
    const char nul[] = "epipe-train-plan 1\nlayers 3\0\n";
    assert_int_equal(train_plan_parse(nul, sizeof nul - 1, &p, err, sizeof err), -1);
    assert_non_null(strstr(err, "byte 0x00"));
    /* too large as a whole */
    char *big = calloc(1, TRAIN_PLAN_FILE_MAX + 2);
    memset(big, '\n', TRAIN_PLAN_FILE_MAX + 1);
    assert_int_equal(train_plan_parse(big, TRAIN_PLAN_FILE_MAX + 1, &p, err, sizeof err), -1);
    assert_non_null(strstr(err, "at most"));
    free(big);
}

static void load_errors(void **state)
{
    (void)state;
    struct train_plan p;
    char err[300];
    assert_int_equal(train_plan_load("/nonexistent/plan", &p, err, sizeof err), -1);
    assert_non_null(strstr(err, "cannot open /nonexistent/plan"));
    char path[] = "/tmp/epipe-plan-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fputs("epipe-train-plan 1\nlayers 3\nbogus\n", f);
    fclose(f);
    assert_int_equal(train_plan_load(path, &p, err, sizeof err), -1);
    if (!strstr(err, path) || !strstr(err, "line 3"))
        fail_msg("'%s' names neither the file nor the line", err);
    remove(path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(round_trip),
        cmocka_unit_test(malformed),
        cmocka_unit_test(load_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
