/* epipe-train's command line: its usage text and the parser that fills the
 * options (schedule, chunks, placement, codecs, model and training knobs). */
#define _POSIX_C_SOURCE 200809L
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <epipe/epipe.h>

#include "../common/idx.h"
#include "cli.h" /* tools/cli.h */
#include "options.h"
#include "plan_auto.h"

/* ---- command line ---------------------------------------------------------- */

void train_usage(FILE *f)
{
    fprintf(f,
            "usage: epipe-train [options]\n"
            "  --stages N          ranks (default 3), one pipeline stage each unless --chunks\n"
            "                      or --placement say otherwise; threads of this process\n"
            "                      unless started by a launcher (then its world size)\n"
            "  --microbatches M    micro-batches a step (default 4)\n"
            "  --schedule KIND     gpipe, 1f1b, interleaved, zb-h1, zb-v, or without a flush\n"
            "                      between steps 1f1b-async (PipeDream: an update after every\n"
            "                      backward, weight stashing) or 1f1b-2bw (one update a step,\n"
            "                      two versions) (default 1f1b)\n"
            "  --chunks V          model chunks (virtual stages) per rank (default: the\n"
            "                      schedule's: 2 for zb-v, else 1)\n"
            "  --placement R,R,... the rank of each pipeline stage, in pipeline order\n"
            "                      (e.g. 0,1,0: rank 0 holds the first and the last layers);\n"
            "                      the rank count is then the largest rank + 1\n"
            "  --act-codec SPEC    codec for activations (default sortquant:bits=8)\n"
            "  --grad-codec SPEC   codec for gradients (default sortquant:bits=8,zero=1)\n"
            "  --epochs E          (default 3)   --batch B (default 64)\n"
            "  --lr LR             (default 0.05) --momentum MU (default 0.9)\n"
            "  --codec-lr LR       learning rate of trainable codecs (insert; default --lr)\n"
            "  --hidden W,W,...    hidden layer widths (default 512,256)\n"
            "  --seed S            (default 1)\n"
            "  --train-limit N     use only the first N training images\n"
            "  --data DIR          Fashion-MNIST IDX files (default %s)\n"
            "  --blas-threads N    threads a BLAS call may use (default 1: the stages\n"
            "                      already keep the cores busy; libepipe's codecs share it)\n"
            "  --quiet             no progress bar\n"
            "  --plan auto|FILE    let the planner choose the split, the codec of each\n"
            "                      boundary and direction, and the schedule: auto profiles\n"
            "                      the model here first (one process; needs --link); FILE\n"
            "                      is a plan --plan-out wrote (docs/planner.md)\n"
            "  --link RATE         the link to plan for: 100Mbit, 1Gbit, 12.5MB (bytes/s)\n"
            "  --link-latency MS   its latency per message (default 0.1)\n"
            "  --plan-codecs LIST  candidates, ';'-separated (default\n"
            "                      sortquant:bits=8,zero=1;sortquant:bits=4,zero=1)\n"
            "  --plan-error E      largest codec error per boundary (relative MSE for\n"
            "                      activations, 1 - cosine for gradients; default none)\n"
            "  --plan-out FILE     write the plan used to FILE\n",
            IDX_FASHION_DIR);
}

int train_parse_args(int argc, char **argv, struct options *o)
{
    enum {
        O_QUIET = 256,
        O_STAGES,
        O_MB,
        O_SCHEDULE,
        O_ACT,
        O_GRAD,
        O_EPOCHS,
        O_BATCH,
        O_LR,
        O_MOMENTUM,
        O_CODEC_LR,
        O_SEED,
        O_TRAIN_LIMIT,
        O_DATA,
        O_BLAS_THREADS,
        O_HIDDEN,
        O_CHUNKS,
        O_PLACEMENT,
        O_PLAN,
        O_PLAN_OUT,
        O_LINK,
        O_LINK_LATENCY,
        O_PLAN_CODECS,
        O_PLAN_ERROR
    };
    static const struct option longopts[] = {
        {"help", no_argument, NULL, 'h'},
        {"quiet", no_argument, NULL, O_QUIET},
        {"stages", required_argument, NULL, O_STAGES},
        {"microbatches", required_argument, NULL, O_MB},
        {"schedule", required_argument, NULL, O_SCHEDULE},
        {"act-codec", required_argument, NULL, O_ACT},
        {"grad-codec", required_argument, NULL, O_GRAD},
        {"epochs", required_argument, NULL, O_EPOCHS},
        {"batch", required_argument, NULL, O_BATCH},
        {"lr", required_argument, NULL, O_LR},
        {"momentum", required_argument, NULL, O_MOMENTUM},
        {"codec-lr", required_argument, NULL, O_CODEC_LR},
        {"seed", required_argument, NULL, O_SEED},
        {"train-limit", required_argument, NULL, O_TRAIN_LIMIT},
        {"data", required_argument, NULL, O_DATA},
        {"blas-threads", required_argument, NULL, O_BLAS_THREADS},
        {"hidden", required_argument, NULL, O_HIDDEN},
        {"chunks", required_argument, NULL, O_CHUNKS},
        {"placement", required_argument, NULL, O_PLACEMENT},
        {"plan", required_argument, NULL, O_PLAN},
        {"plan-out", required_argument, NULL, O_PLAN_OUT},
        {"link", required_argument, NULL, O_LINK},
        {"link-latency", required_argument, NULL, O_LINK_LATENCY},
        {"plan-codecs", required_argument, NULL, O_PLAN_CODECS},
        {"plan-error", required_argument, NULL, O_PLAN_ERROR},
        {NULL, 0, NULL, 0},
    };
    opterr = 0;
    int opt, stages_set = 0;
/* The option's value as an integer or a finite number in [lo, hi], into
 * dst, or a message and -1 (tools/cli.h). */
#define INT_OPT(name, lo, hi, dst) EPIPE_CLI_INT_OR(-1, "epipe-train", name, lo, hi, dst)
#define REAL_OPT(name, lo, hi, dst) EPIPE_CLI_REAL_OR(-1, "epipe-train", name, lo, hi, dst)
    while ((opt = getopt_long(argc, argv, ":h", longopts, NULL)) != -1) {
        const char *v = optarg;
        switch (opt) {
        case 'h': train_usage(stdout); exit(0);
        case O_QUIET: o->quiet = 1; break;
        case O_STAGES:
            INT_OPT("--stages", 1, 64, o->stages);
            stages_set = o->stages_set = 1;
            break;
        case O_CHUNKS: INT_OPT("--chunks", 1, 8, o->chunks); break;
        case O_PLACEMENT:
            o->nplace = 0;
            for (const char *p = v; *p;) {
                char *end;
                long rk = strtol(p, &end, 10);
                if (end == p || rk < 0 || rk > 63 || (*end && *end != ',') ||
                    o->nplace == sizeof o->placement / sizeof o->placement[0]) {
                    fprintf(stderr,
                            "epipe-train: bad --placement '%s': ranks 0..63, comma-separated, "
                            "at most 64 pipeline stages\n",
                            v);
                    return -1;
                }
                o->placement[o->nplace++] = (unsigned)rk;
                p = *end ? end + 1 : end;
            }
            break;
        case O_MB: INT_OPT("--microbatches", 1, MODEL_MAX_MB, o->microbatches); break;
        case O_SCHEDULE:
            o->schedule = v;
            o->schedule_set = 1;
            break;
        case O_ACT:
            o->act_codec = v;
            o->codecs_set = 1;
            break;
        case O_GRAD:
            o->grad_codec = v;
            o->codecs_set = 1;
            break;
        case O_PLAN: o->plan = v; break;
        case O_PLAN_OUT: o->plan_out = v; break;
        case O_PLAN_CODECS: o->plan_codecs = v; break;
        case O_LINK:
            if (train_parse_rate(v, &o->link_rate)) {
                fprintf(stderr,
                        "epipe-train: bad --link '%s' (a rate: 100Mbit, 1Gbit, 12.5MB, or "
                        "bytes/s)\n",
                        v);
                return -1;
            }
            break;
        case O_LINK_LATENCY:
        case O_PLAN_ERROR: {
            char *end;
            double x = strtod(v, &end);
            if (end == v || *end || !(x >= 0) || x > 1e6) {
                fprintf(stderr, "epipe-train: bad --%s '%s' (a number >= 0)\n",
                        opt == O_PLAN_ERROR ? "plan-error" : "link-latency", v);
                return -1;
            }
            if (opt == O_PLAN_ERROR)
                o->plan_error = x;
            else
                o->link_latency = x / 1e3;
            break;
        }
        case O_EPOCHS: INT_OPT("--epochs", 1, 1000000, o->epochs); break;
        case O_BATCH: INT_OPT("--batch", 1, 1 << 20, o->batch); break;
        case O_LR: REAL_OPT("--lr", 0, 1e6, o->lr); break;
        /* the built-in SGD's range (epipe_codec_sgd_step): below 1 */
        case O_MOMENTUM: REAL_OPT("--momentum", 0, 0.9999, o->momentum); break;
        case O_CODEC_LR: REAL_OPT("--codec-lr", 0, 1e6, o->codec_lr); break;
        case O_SEED: INT_OPT("--seed", 0, LLONG_MAX, o->seed); break;
        case O_TRAIN_LIMIT: INT_OPT("--train-limit", 1, INT32_MAX, o->train_limit); break;
        case O_DATA: o->data_dir = v; break;
        case O_BLAS_THREADS: INT_OPT("--blas-threads", 1, 256, o->blas_threads); break;
        case O_HIDDEN:
            o->nhidden = 0;
            for (const char *p = v; *p;) {
                char *end;
                long w = strtol(p, &end, 10);
                if (end == p || w < 1 || w > 65536 || (*end && *end != ',') ||
                    (*end == ',' && !end[1]) || o->nhidden == MODEL_MAX_LAYERS - 1) {
                    fprintf(stderr,
                            "epipe-train: bad --hidden '%s': widths 1..65536, comma-separated, "
                            "at most %d\n",
                            v, MODEL_MAX_LAYERS - 1);
                    return -1;
                }
                o->hidden[o->nhidden++] = (int)w;
                p = *end == ',' ? end + 1 : end;
            }
            break;
        default: /* ':' or '?' */ epipe_cli_bad_option("epipe-train", argv, opt); return -1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "epipe-train: unexpected argument '%s' (options start with --)\n",
                argv[optind]);
        return -1;
    }
    if (o->microbatches < 1 || o->microbatches > MODEL_MAX_MB || o->batch < 1 ||
        o->batch % (int)o->microbatches || o->batch / (int)o->microbatches > 1024) {
        fprintf(stderr,
                "epipe-train: --batch %d must divide into --microbatches %u (at most %d, "
                "and at most 1024 rows each)\n",
                o->batch, o->microbatches, MODEL_MAX_MB);
        return -1;
    }
    if (o->nplace) {
        unsigned ranks = 0;
        unsigned char holds[64] = {0}; /* ranks are 0..63 (parsed above) */
        for (unsigned i = 0; i < o->nplace; i++) {
            ranks = o->placement[i] + 1 > ranks ? o->placement[i] + 1 : ranks;
            holds[o->placement[i]] = 1;
        }
        if (stages_set && o->stages != ranks) {
            fprintf(stderr, "epipe-train: --placement names ranks 0..%u but --stages is %u\n",
                    ranks - 1, o->stages);
            return -1;
        }
        for (unsigned r = 0; r < ranks; r++)
            if (!holds[r]) {
                fprintf(stderr,
                        "epipe-train: --placement names rank %u, so ranks 0..%u run, but rank %u "
                        "holds no pipeline stage\n",
                        ranks - 1, ranks - 1, r);
                return -1;
            }
        if (o->nplace > (unsigned)o->nhidden + 1) {
            fprintf(stderr,
                    "epipe-train: --placement lists %u pipeline stages but the model has %d "
                    "layers (one layer a stage at least)\n",
                    o->nplace, o->nhidden + 1);
            return -1;
        }
        o->stages = ranks;
    }
    /* with --plan and no --stages the plan says how many (checked then) */
    int stages_known = !o->plan || stages_set;
    if (o->stages < 1 || (stages_known && !o->nplace && o->stages > (unsigned)o->nhidden + 1)) {
        fprintf(stderr,
                "epipe-train: --stages %u: the model has %d layers, and each stage needs one at "
                "least\n",
                o->stages, o->nhidden + 1);
        return -1;
    }
    /* the codecs' own checks, before any rank starts (--plan chooses its own) */
    const char *specs[2] = {o->act_codec, o->grad_codec}, *names[2] = {"act", "grad"};
    for (int k = 0; k < 2 && !o->plan; k++) {
        epipe_codec *probe;
        if (!specs[k])
            continue;
        if (epipe_codec_create(&probe, specs[k]) != EPIPE_OK) {
            fprintf(stderr, "epipe-train: bad --%s-codec '%s': %s\n", names[k], specs[k],
                    epipe_last_error());
            return -1;
        }
        double ef = 0;
        int ef_on_act = k == 0 && epipe_codec_spec_param(probe, "ef", &ef) == EPIPE_OK && ef == 1;
        epipe_codec_destroy(probe);
        if (ef_on_act) {
            fprintf(stderr,
                    "epipe-train: bad --act-codec '%s': ef=1 (error feedback) is for "
                    "gradients (--grad-codec)\n",
                    specs[k]);
            return -1;
        }
    }
    if (o->plan) {
        const char *clash = o->codecs_set                ? "--act-codec/--grad-codec"
                            : o->chunks > 1 || o->nplace ? "--chunks/--placement"
                                                         : NULL;
        if (clash) {
            fprintf(stderr,
                    "epipe-train: --plan chooses the codecs and one pipeline stage a rank; "
                    "leave out %s\n",
                    clash);
            return -1;
        }
        if (strcmp(o->plan, "auto") == 0 && !(o->link_rate > 0)) {
            fprintf(stderr, "epipe-train: --plan auto needs --link RATE, the link between "
                            "stages to plan for (e.g. --link 100Mbit)\n");
            return -1;
        }
    } else if (o->plan_out || o->link_rate > 0 || o->plan_error >= 0 || o->plan_codecs) {
        fprintf(stderr, "epipe-train: --plan-out, --link, --plan-codecs and --plan-error go "
                        "with --plan\n");
        return -1;
    }
    return 0;
}
