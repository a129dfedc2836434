/* The run-time version, so a program can detect a header/library mismatch. */
#include <epipe/common.h>

#define EPIPE_STR2(x) #x
#define EPIPE_STR(x) EPIPE_STR2(x)

EPIPE_API unsigned epipe_version(void)
{
    return EPIPE_VERSION_NUMBER;
}

EPIPE_API const char *epipe_version_string(void)
{
    return EPIPE_STR(EPIPE_VERSION_MAJOR) "." EPIPE_STR(EPIPE_VERSION_MINOR) "." EPIPE_STR(
        EPIPE_VERSION_PATCH);
}
