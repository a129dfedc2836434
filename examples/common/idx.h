/* Reading IDX files (the MNIST family's format), gzip-compressed or plain,
 * as the Debian package dataset-fashion-mnist installs them. */
#ifndef EPIPE_EXAMPLES_IDX_H
#define EPIPE_EXAMPLES_IDX_H

#include <stddef.h>
#include <stdint.h>

#define IDX_FASHION_DIR "/usr/share/datasets/fashion-mnist"

/* Every byte of these files is checked as hostile input: a header must
 * describe a plausible shape before it sizes an allocation, and the file
 * must end where the header says (for gzip, with its checksum right). */

/* Images as floats normalised with the given mean and standard deviation of
 * the raw bytes (pass sd <= 0 to use the file's own). *count and *pixels
 * get the image count and pixels per image. NULL on error, with
 * why[0..whylen) a message that names the file and the problem. */
float *idx_load_images(const char *path, double mean, double sd, uint32_t *count, uint32_t *pixels,
                       char *why, size_t whylen);
/* Labels as bytes, each below `classes` (1..256); NULL on error, as above,
 * a label out of range included. */
uint8_t *idx_load_labels(const char *path, unsigned classes, uint32_t *count, char *why,
                         size_t whylen);

#endif
