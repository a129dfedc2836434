/* A TCP port on 127.0.0.1 that nothing listens on at the moment of the
 * call, for tests whose ranks meet over loopback. */
#ifndef EPIPE_TESTS_LOOPBACK_H
#define EPIPE_TESTS_LOOPBACK_H

/* The port, or 0 (errno set) when no socket could be bound. Another
 * program may take it before the caller does: a test that fails to listen
 * on it should say so. */
unsigned loopback_free_port(void);

#endif
