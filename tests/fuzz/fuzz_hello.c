/* Fuzz target: the TCP setup's hello decoder and its framed-message reader.
 * Byte 0 picks: even, the rest is a hello payload; odd, it is a byte stream. */
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../../transport/tcp_setup.h"
#include "fuzz.h"

/* A decoded hello encodes to bytes that decode to the same hello. */
static void check_hello(const uint8_t *p, size_t n)
{
    struct epipe_tcp_hello h, h2;
    if (epipe_tcp_hello_decode(p, n, &h) != EPIPE_OK) {
        if (epipe_last_error()[0] == '\0')
            abort();
        return;
    }
    if (h.addr[EPIPE_TCP_ADDR_MAX - 1] != '\0')
        abort();
    for (const char *a = h.addr; *a; a++) /* an address is text: it is logged */
        if ((unsigned char)*a < 0x20 || (unsigned char)*a >= 0x7f)
            abort();
    uint8_t buf[HELLO_SIZE];
    epipe_tcp_hello_encode(&h, buf);
    if (epipe_tcp_hello_decode(buf, sizeof buf, &h2) != EPIPE_OK || h.type != h2.type ||
        h.flags != h2.flags || h.rank != h2.rank || h.size != h2.size || h.stream != h2.stream ||
        h.port != h2.port || strcmp(h.addr, h2.addr) || memcmp(h.nonce, h2.nonce, sizeof h.nonce) ||
        memcmp(h.mac, h2.mac, sizeof h.mac) || h.job != h2.job)
        abort();
}

/* The bytes arrive on a socket: every message the reader completes stays
 * within its payload limit (what an unauthenticated peer can make it
 * allocate), and every hello in one is decoded. */
static void check_stream(const uint8_t *p, size_t n, uint64_t limit)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sv) != 0)
        return;
    if (n > 65536)
        n = 65536;
    if (n && write(sv[0], p, n) != (ssize_t)n) {
        close(sv[0]);
        close(sv[1]);
        return;
    }
    close(sv[0]); /* the peer is done: the reader ends with an error or a message */
    struct epipe_tcp_reader r;
    memset(&r, 0, sizeof r);
    r.limit = limit;
    for (int i = 0; i < 64; i++) {
        int rc = epipe_tcp_reader_step(sv[1], &r);
        if (rc <= 0)
            break;
        if (r.h.payload_len > (limit ? limit : HS_MAX_UNAUTH))
            abort();
        if (r.h.kind == EPIPE_WIRE_HELLO)
            check_hello(r.payload, (size_t)r.h.payload_len);
        epipe_tcp_reader_reset(&r);
    }
    epipe_tcp_reader_reset(&r);
    close(sv[1]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    if (data[0] % 2 == 0)
        check_hello(data + 1, size - 1);
    else
        check_stream(data + 1, size - 1, data[0] & 2 ? HELLO_SIZE + TABLE_ENTRY * 3 : 0);
    return 0;
}
