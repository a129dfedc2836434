/* CRC32C (Castagnoli, reflected polynomial 0x82F63B78): the checksum of
 * every wire header and payload. Portable slicing-by-8 plus SSE4.2
 * (three interleaved crc32 chains joined by table-driven shifts). */
#ifndef EPIPE_LIB_WIRE_CRC32C_H
#define EPIPE_LIB_WIRE_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* All three compute the standard CRC32C (initial value and final xor
 * 0xFFFFFFFF, as iSCSI, ext4 and RFC 3720 define it) and chain like zlib's
 * crc32(): start with crc = 0 and pass the previous result to continue, so
 * crc32c(crc32c(0, a, n), b, m) is the CRC of a followed by b.
 * crc32c(0, "123456789", 9) == 0xE3069283. Thread-safe; buf may be NULL
 * when len is 0. */

/* The fastest path this CPU has, chosen at run time. */
uint32_t epipe_crc32c(uint32_t crc, const void *buf, size_t len);

/* The portable reference: table-driven, slicing-by-8. */
uint32_t epipe_crc32c_ref(uint32_t crc, const void *buf, size_t len);

/* 1 when the CPU has a hardware CRC32C instruction that
 * epipe_crc32c_hw uses (SSE4.2 on x86-64); 0 otherwise. */
int epipe_crc32c_hw_available(void);

/* The hardware path; falls back to the reference when
 * epipe_crc32c_hw_available() is 0. For tests and benchmarks. */
uint32_t epipe_crc32c_hw(uint32_t crc, const void *buf, size_t len);

/* The hardware instruction in one dependent chain (the fast path before the
 * three-way one), kept to check and time the three-way path against. */
uint32_t epipe_crc32c_hw_1way(uint32_t crc, const void *buf, size_t len);

#endif
