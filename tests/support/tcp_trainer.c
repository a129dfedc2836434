/* One rank of the test MLP's pipelined training over TCP (the rendezvous
 * from the environment, as epipe-run sets it), or the one-process reference. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <epipe/epipe.h>

#include "pipeline_host.h"

static void usage(void)
{
    fprintf(
        stderr,
        "usage: tcp_trainer [--schedule KIND] [--chunks V] [--placement R,R,...] [--split 0|1]\n"
        "                   [--stream 0|1]\n"
        "                   [--raw R,R,...]\n"
        "                   [--micro M] [--steps N] [--codec SPEC]\n"
        "                   [--options SPEC] [--out PREFIX] [--die-rank R --die-after-ms MS]\n"
        "       tcp_trainer --reference P [--schedule KIND] [--micro M] [--steps N] [--out "
        "PREFIX]\n"
        "Trains this rank's chunks (rank and size from the environment) and writes the\n"
        "parameters of each layer it holds to PREFIX.layerL; --reference writes every\n"
        "layer of the one-process result the same way (for 1f1b-async and 1f1b-2bw, the\n"
        "stale-weights reference of P stages; P is ignored for the others). --split 1 uses the "
        "split-backward\n"
        "callbacks; --stream 1 drives the stage by the op stream. --raw runs the test's raw op "
        "lists (pipeline_host.h) over that\n"
        "placement instead of a schedule kind. Exit 0, 2 for usage, 3 when training fails.\n");
}

/* The parameters of each layer l with owns[l] (NULL: all) as raw floats, w
 * then b, in PREFIX.layerL. */
static int write_params(const char *prefix, const mlp_layer *layers, const unsigned char *owns)
{
    for (int l = 0; l < host_nlayers; l++) {
        if (owns && !owns[l])
            continue;
        char path[1024];
        snprintf(path, sizeof path, "%s.layer%d", prefix, l);
        FILE *f = fopen(path, "wb");
        if (!f)
            return -1;
        fwrite(layers[l].w, sizeof(float), (size_t)(layers[l].in * layers[l].out), f);
        fwrite(layers[l].b, sizeof(float), (size_t)layers[l].out, f);
        if (fclose(f))
            return -1;
    }
    return 0;
}

static int die_after_ms;

static void *killer(void *arg)
{
    (void)arg;
    struct timespec ts = {die_after_ms / 1000, (die_after_ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    raise(SIGKILL); /* as kill -9 from outside: no cleanup, no goodbye */
    return NULL;
}

int main(int argc, char **argv)
{
    struct host_config cfg = {.schedule = "1f1b", .microbatches = 4, .steps = 20};
    const char *codec = NULL, *options = NULL, *out = NULL;
    int reference = 0, die_rank = -1;
    unsigned placement[64];
    static struct host_raw_layout raw;
    int use_raw = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help")) {
            usage();
            return 0;
        }
        if (!v) {
            usage();
            return 2;
        }
        i++;
        if (!strcmp(a, "--schedule"))
            cfg.schedule = v;
        else if (!strcmp(a, "--chunks"))
            cfg.chunks = (unsigned)atoi(v);
        else if (!strcmp(a, "--split"))
            cfg.split = atoi(v);
        else if (!strcmp(a, "--raw")) {
            use_raw = 1;
            raw.P = 0;
            for (const char *q = v; *q && raw.P < HOST_RAW_MAX_STAGES;) {
                char *end;
                raw.placement[raw.P++] = (unsigned)strtoul(q, &end, 10);
                if (end == q) {
                    usage();
                    return 2;
                }
                q = *end == ',' ? end + 1 : end;
            }
        } else if (!strcmp(a, "--placement")) {
            cfg.placement_len = 0;
            for (const char *q = v; *q && cfg.placement_len < 64;) {
                char *end;
                placement[cfg.placement_len++] = (unsigned)strtoul(q, &end, 10);
                if (end == q) {
                    usage();
                    return 2;
                }
                q = *end == ',' ? end + 1 : end;
            }
            cfg.placement = placement;
        } else if (!strcmp(a, "--micro"))
            cfg.microbatches = (unsigned)atoi(v);
        else if (!strcmp(a, "--steps"))
            cfg.steps = atoi(v);
        else if (!strcmp(a, "--codec"))
            codec = v;
        else if (!strcmp(a, "--options"))
            options = v;
        else if (!strcmp(a, "--stream"))
            cfg.use_op_stream = atoi(v);
        else if (!strcmp(a, "--out"))
            out = v;
        else if (!strcmp(a, "--reference"))
            reference = atoi(v);
        else if (!strcmp(a, "--die-rank"))
            die_rank = atoi(v);
        else if (!strcmp(a, "--die-after-ms"))
            die_after_ms = atoi(v);
        else {
            usage();
            return 2;
        }
    }
    if (cfg.microbatches < 1 || cfg.microbatches > HOST_MAX_MB || cfg.steps < 1) {
        usage();
        return 2;
    }
    cfg.act_codec = cfg.grad_codec = codec;
    if (use_raw) {
        raw.m = cfg.microbatches;
        raw.split = cfg.split;
        if (host_build_raw(&raw)) {
            usage();
            return 2;
        }
        cfg.create = host_create_raw;
        cfg.create_arg = &raw;
    }

    if (reference > 0) {
        mlp_layer layers[HOST_MAX_LAYERS];
        double first, last;
        /* --schedule 1f1b-async or 1f1b-2bw: the stale-weights reference
         * over `reference` stages */
        epipe_schedule *sc = NULL;
        int weights = EPIPE_WEIGHTS_FLUSH;
        if (epipe_schedule_create(&sc, cfg.schedule, (unsigned)reference, cfg.microbatches) ==
            EPIPE_OK)
            weights = epipe_schedule_weights(sc);
        epipe_schedule_destroy(sc);
        if (weights != EPIPE_WEIGHTS_FLUSH)
            host_reference_async(weights, (unsigned)reference, cfg.microbatches, cfg.steps, layers,
                                 &first, &last);
        else
            host_reference(cfg.microbatches, cfg.steps, layers, &first, &last);
        if (out && write_params(out, layers, NULL))
            return 3;
        printf("reference: loss first %.9g last %.9g\n", first, last);
        for (int l = 0; l < host_nlayers; l++)
            mlp_layer_free(&layers[l]);
        return 0;
    }

    epipe_comm *comm;
    int rc = epipe_comm_create_from_env(&comm, options);
    if (rc) {
        printf("init FAILED %s: %s\n", epipe_status_name(rc), epipe_last_error());
        return 3;
    }
    unsigned rank = epipe_comm_rank(comm);
    if ((int)rank == die_rank) {
        pthread_t th;
        pthread_create(&th, NULL, killer, NULL);
        pthread_detach(th);
    }
    struct host_result res;
    host_run(comm, &cfg, &res); /* destroys comm */
    if (res.rc) {
        printf("rank %u: training FAILED %s: %s\n", rank, epipe_status_name(res.rc), res.error);
        host_result_free(&res);
        return 3;
    }
    if (res.holds_last)
        printf("rank %u: loss first %.9g last %.9g\n", rank, res.first_loss, res.last_loss);
    printf("rank %u: ok, %llu steps, sent %llu wire bytes\n", rank,
           (unsigned long long)res.stats.steps,
           (unsigned long long)(res.stats.act_sent_wire + res.stats.grad_sent_wire));
    if (out && write_params(out, res.layers, res.owns))
        rc = 3;
    host_result_free(&res);
    return rc;
}
