/* libepipe: pipeline-parallel training over slow links.
 * The umbrella header: include this one and get the whole public API. */
#ifndef EPIPE_EPIPE_H
#define EPIPE_EPIPE_H

#include <epipe/common.h>
#include <epipe/codec.h>

#endif /* EPIPE_EPIPE_H */
