/* The pipeline host's raw op lists (pipeline_host.h): the runtime without a
 * schedule kind, through the library's internal epipe_stage_create_raw().
 * Apart from pipeline_host.c so that a host linked against the public
 * libepipe.so alone (test_starvation.c) can use the rest. */
#include <string.h>

#include "pipeline_host.h"
#include "stage/stage_raw.h"

static int put(struct host_raw_layout *L, unsigned g, uint32_t kind, unsigned mb)
{
    unsigned r = L->placement[g], chunk = 0;
    for (unsigned k = 0; k < g; k++)
        chunk += L->placement[k] == r;
    if (r >= HOST_RAW_MAX_RANKS || L->n[r] >= HOST_RAW_MAX_OPS)
        return -1;
    L->ops[r][L->n[r]++] = (epipe_op){.kind = kind, .microbatch = mb, .chunk = chunk};
    return 0;
}

int host_build_raw(struct host_raw_layout *L)
{
    int bad = L->P > HOST_RAW_MAX_STAGES;
    memset(L->n, 0, sizeof L->n);
    for (unsigned mb = 0; !bad && mb < L->m; mb++)
        for (unsigned g = 0; g < L->P; g++) {
            if (g > 0)
                bad |= put(L, g, EPIPE_OP_RECV_ACT, mb);
            bad |= put(L, g, EPIPE_OP_FORWARD, mb);
            if (g + 1 < L->P)
                bad |= put(L, g, EPIPE_OP_SEND_ACT, mb);
        }
    for (unsigned mb = 0; !bad && mb < L->m; mb++)
        for (unsigned g = L->P; g-- > 0;) {
            if (g + 1 < L->P)
                bad |= put(L, g, EPIPE_OP_RECV_GRAD, mb);
            bad |= put(L, g, L->split ? EPIPE_OP_BACKWARD_INPUT : EPIPE_OP_BACKWARD, mb);
            if (g > 0)
                bad |= put(L, g, EPIPE_OP_SEND_GRAD, mb);
        }
    for (unsigned mb = 0; !bad && L->split && mb < L->m; mb++)
        for (unsigned g = 0; g < L->P; g++)
            bad |= put(L, g, EPIPE_OP_BACKWARD_WEIGHT, mb);
    return bad ? -1 : 0;
}

int host_create_raw(epipe_stage **out, epipe_comm *comm, const struct host_config *cfg)
{
    const struct host_raw_layout *L = cfg->create_arg;
    unsigned r = epipe_comm_rank(comm);
    if (r >= HOST_RAW_MAX_RANKS)
        return EPIPE_EINVAL;
    return epipe_stage_create_raw(out, comm, L->m, L->P, L->placement, L->ops[r], L->n[r],
                                  L->split);
}
