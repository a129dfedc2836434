/* The subproject consumer: links libepipe through dependency('epipe') and
 * round-trips a tensor through a codec. */
#include <stdio.h>

#include <epipe/epipe.h>

int main(void)
{
    float x[4] = {1, -2, 3, -4}, y[4] = {0};
    int64_t n = 4;
    DLTensor tx = {
        .data = x, .device = {kDLCPU, 0}, .ndim = 1, .dtype = {kDLFloat, 32, 1}, .shape = &n};
    DLTensor ty = tx;
    ty.data = y;
    unsigned char buf[256];
    size_t len = 0;
    epipe_codec *c;
    if (epipe_codec_create(&c, "none") != EPIPE_OK)
        return 1;
    int rc = epipe_codec_encode(c, &tx, buf, sizeof buf, &len);
    if (rc == EPIPE_OK)
        rc = epipe_codec_decode(c, buf, len, &ty);
    epipe_codec_destroy(c);
    if (rc != EPIPE_OK || y[3] != -4) {
        fprintf(stderr, "consumer: %s\n", epipe_last_error());
        return 1;
    }
    printf("consumer: libepipe %s as a subproject\n", epipe_version_string());
    return 0;
}
