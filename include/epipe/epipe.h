/* libepipe: pipeline-parallel training over slow links.
 * The umbrella header: include this one and get the whole public API. */
#ifndef EPIPE_EPIPE_H
#define EPIPE_EPIPE_H

#include <epipe/codec.h>
#include <epipe/comm.h>
#include <epipe/common.h>
#include <epipe/plan.h>
#include <epipe/schedule.h>
#include <epipe/stage.h>

#endif /* EPIPE_EPIPE_H */
