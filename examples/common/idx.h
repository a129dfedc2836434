/* Reading IDX files (the MNIST family's format), gzip-compressed or plain,
 * as the Debian package dataset-fashion-mnist installs them. */
#ifndef EPIPE_EXAMPLES_IDX_H
#define EPIPE_EXAMPLES_IDX_H

#include <stdint.h>

#define IDX_FASHION_DIR "/usr/share/datasets/fashion-mnist"

/* Images as floats normalised with the given mean and standard deviation of
 * the raw bytes (pass sd <= 0 to use the file's own). *count and *pixels
 * get the image count and pixels per image. NULL on error, with a message
 * on stderr that names the file and the problem. */
float *idx_load_images(const char *path, double mean, double sd, uint32_t *count, uint32_t *pixels);
/* Labels as bytes; NULL on error, as above. */
uint8_t *idx_load_labels(const char *path, uint32_t *count);

#endif
