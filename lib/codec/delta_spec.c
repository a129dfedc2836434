/* Activation deltas: the core spec keys delta, delta_mb, delta_strict and
 * delta_raw
 * (parsed beside each codec's own keys, written into the canonical spec). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

/* ---- spec keys --------------------------------------------------------- */

enum { NKEYS = 4 };
static const char *const dkeys[NKEYS] = {"delta", "delta_mb", "delta_strict", "delta_raw"};
static const double dmin[NKEYS] = {0, 1, 0, 0}, dmax[NKEYS] = {1, 1048576, 1, 1};

static int key_index(const char *k, size_t len)
{
    for (int i = 0; i < NKEYS; i++)
        if (strlen(dkeys[i]) == len && memcmp(dkeys[i], k, len) == 0)
            return i;
    return -1;
}

int epipe_codec_delta_parse(epipe_codec *c, const char *key, size_t klen, const char *v,
                            size_t vlen)
{
    int i = key_index(key, klen);
    const char *name = c->ops->name;
    if (i < 0 || epipe_codec_param_index(c->ops, dkeys[i]) >= 0)
        return 1; /* not ours: the codec's own key, or unknown */
    if (c->ops == &epipe_codec_none)
        return epipe_fail(EPIPE_EINVAL, "none: key '%s' does not apply: the codec is lossless",
                          dkeys[i]);
    if (!epipe_codec_ef_allowed(c->ops))
        return epipe_fail(EPIPE_EINVAL,
                          "%s: key '%s' does not apply to a trainable codec or a chain (the "
                          "delta of a code is not the code of a delta)",
                          name, dkeys[i]);
    if (c->delta_seen & (1u << i))
        return epipe_fail(EPIPE_EINVAL, "%s: key '%s' is given twice", name, dkeys[i]);
    char buf[16];
    char *end;
    if (vlen == 0 || vlen >= sizeof buf)
        return epipe_fail(EPIPE_EINVAL, "%s: key '%s' = '%.*s' is not an integer in %.0f..%.0f",
                          name, dkeys[i], (int)(vlen < 32 ? vlen : 32), v, dmin[i], dmax[i]);
    memcpy(buf, v, vlen);
    buf[vlen] = '\0';
    long x = strtol(buf, &end, 10);
    if (*end || buf[0] < '0' || buf[0] > '9' || x < dmin[i] || x > dmax[i])
        return epipe_fail(EPIPE_EINVAL, "%s: key '%s' = '%s' is not an integer in %.0f..%.0f", name,
                          dkeys[i], buf, dmin[i], dmax[i]);
    c->delta_seen |= 1u << i;
    if (i == 0)
        c->delta = (int)x;
    else if (i == 1)
        c->delta_mb = (unsigned)x;
    else if (i == 2)
        c->delta_strict = (int)x;
    else
        c->delta_raw = (int)x;
    return EPIPE_OK;
}

int epipe_codec_delta_check(epipe_codec *c)
{
    if (!c->delta_mb)
        c->delta_mb = EPIPE_CODEC_DELTA_MB_DEFAULT;
    if (!(c->delta_seen & 8u))
        c->delta_raw = 1;
    if (!c->delta && (c->delta_seen & 14u))
        return epipe_fail(EPIPE_EINVAL,
                          "%s: keys delta_mb, delta_strict and delta_raw need delta=1",
                          c->ops->name);
    if (c->delta && c->ef)
        return epipe_fail(EPIPE_EINVAL,
                          "%s: delta=1 and ef=1 together are not supported: delta is for "
                          "activations, ef for gradients (use one handle for each)",
                          c->ops->name);
    return EPIPE_OK;
}

void epipe_codec_delta_spec(epipe_codec *c)
{
    size_t len = strlen(c->spec);
    if (!c->delta || len >= sizeof c->spec)
        return;
    char extra[64];
    int m = snprintf(extra, sizeof extra, "delta=1");
    if (c->delta_mb != EPIPE_CODEC_DELTA_MB_DEFAULT)
        m += snprintf(extra + m, sizeof extra - (size_t)m, ",delta_mb=%u", c->delta_mb);
    if (c->delta_strict)
        m += snprintf(extra + m, sizeof extra - (size_t)m, ",delta_strict=1");
    if (!c->delta_raw)
        snprintf(extra + m, sizeof extra - (size_t)m, ",delta_raw=0");
    snprintf(c->spec + len, sizeof c->spec - len, "%c%s", strchr(c->spec, ':') ? ',' : ':', extra);
}

int epipe_codec_delta_key_info(const epipe_codec_ops *ops, const char *key, const epipe_codec *c,
                               double *value, double *min, double *max)
{
    int i = key_index(key, strlen(key));
    if (i < 0 || !epipe_codec_ef_allowed(ops) || epipe_codec_param_index(ops, key) >= 0)
        return 0;
    if (value)
        *value = i == 0   ? (double)c->delta
                 : i == 1 ? (double)c->delta_mb
                 : i == 2 ? (double)c->delta_strict
                          : (double)c->delta_raw;
    if (min)
        *min = dmin[i];
    if (max)
        *max = dmax[i];
    return 1;
}
