/* Codec spec strings: "name[:key=value[,key=value]...]" parsed against the
 * codec's parameter table, and the canonical spec written back. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

int epipe_codec_param_index(const epipe_codec_ops *ops, const char *key)
{
    for (unsigned k = 0; k < ops->nparams; k++)
        if (strcmp(ops->params[k].key, key) == 0)
            return (int)k;
    return -1;
}

int epipe_codec_ef_allowed(const epipe_codec_ops *ops)
{
    return ops != &epipe_codec_none && ops != &epipe_codec_chain && !ops->code_shape;
}

/* The core key ef=0|1 (error feedback, lib/codec/ef.c), on any codec that
 * allows it. It changes only what the sender encodes, never the payload's
 * format or parameter word. */
static int parse_ef(epipe_codec *c, const char *v, size_t vlen)
{
    const epipe_codec_ops *ops = c->ops;
    if (ops == &epipe_codec_none)
        return epipe_fail(EPIPE_EINVAL, "none: key 'ef' does not apply: the codec is lossless");
    if (!epipe_codec_ef_allowed(ops))
        return epipe_fail(EPIPE_EINVAL,
                          "%s: key 'ef' does not apply to a trainable codec (its code is not "
                          "the gradient it was given)",
                          ops->name);
    if (vlen == 1 && (v[0] == '0' || v[0] == '1')) {
        c->ef = v[0] == '1';
        return EPIPE_OK;
    }
    return epipe_fail(EPIPE_EINVAL, "%s: key 'ef' = '%.*s' is not 0 or 1", ops->name,
                      (int)(vlen < 32 ? vlen : 32), v);
}

static int parse_value(const epipe_codec_ops *ops, const epipe_param_desc *d, const char *v,
                       size_t vlen, double *out)
{
    char buf[64];
    if (vlen == 0)
        return epipe_fail(EPIPE_EINVAL, "%s: key '%s' has an empty value", ops->name, d->key);
    if (vlen >= sizeof buf)
        return epipe_fail(EPIPE_EINVAL, "%s: value of key '%s' is too long", ops->name, d->key);
    memcpy(buf, v, vlen);
    buf[vlen] = '\0';
    if (d->kind == EPIPE_PARAM_CHOICE) {
        char options[96] = "";
        for (unsigned i = 0; d->choices[i]; i++) {
            if (strcmp(buf, d->choices[i]) == 0) {
                *out = i;
                return EPIPE_OK;
            }
            strncat(options, i ? "|" : "", sizeof options - strlen(options) - 1);
            strncat(options, d->choices[i], sizeof options - strlen(options) - 1);
        }
        return epipe_fail(EPIPE_EINVAL, "%s: key '%s' = '%s' is not one of %s", ops->name, d->key,
                          buf, options);
    }
    char *end;
    double x = strtod(buf, &end);
    if (*end != '\0' || !isfinite(x) || buf[0] == ' ')
        return epipe_fail(EPIPE_EINVAL, "%s: key '%s' = '%s' is not a number", ops->name, d->key,
                          buf);
    if (d->kind == EPIPE_PARAM_INT && x != floor(x))
        return epipe_fail(EPIPE_EINVAL, "%s: key '%s' = '%s' is not an integer", ops->name, d->key,
                          buf);
    if (x < d->min || x > d->max) {
        if (d->kind == EPIPE_PARAM_INT)
            return epipe_fail(EPIPE_EINVAL, "%s: key '%s' = %s is out of range %.0f..%.0f",
                              ops->name, d->key, buf, d->min, d->max);
        return epipe_fail(EPIPE_EINVAL, "%s: key '%s' = %s is out of range [%g, %g]", ops->name,
                          d->key, buf, d->min, d->max);
    }
    *out = x;
    return EPIPE_OK;
}

/* Writes a real so that strtod gives back exactly the same double. */
static void format_real(char *buf, size_t cap, double x)
{
    for (int prec = 6; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, x);
        if (strtod(buf, NULL) == x)
            return;
    }
}

const char *const epipe_param_bool[] = {"0", "1", NULL};

/* Parameter k's value when the spec leaves it out: its default, but for
 * zero under delta=1, which is 1. delta=1 codes signed changes, and a
 * quantizer whose grid misses 0 adds the same offset to every unchanged
 * value, epoch after epoch, to both stored rows (docs/codecs.md). */
static double param_default(const epipe_codec *c, unsigned k)
{
    const epipe_param_desc *d = &c->ops->params[k];
    return c->delta && strcmp(d->key, "zero") == 0 ? 1 : d->def;
}

static void build_canonical_spec(epipe_codec *c)
{
    const epipe_codec_ops *ops = c->ops;
    size_t len = (size_t)snprintf(c->spec, sizeof c->spec, "%s", ops->name);
    for (unsigned i = 0, first = 1; i < ops->nparams && len < sizeof c->spec; i++) {
        const epipe_param_desc *d = &ops->params[i];
        char val[40];
        if (isnan(c->p[i])) /* left for the codec to choose per tensor */
            continue;
        /* left out only where the spec's reading gives it back: zero=0
         * stays in a delta=1 spec */
        if (d->quiet_default && c->p[i] == d->def && c->p[i] == param_default(c, i))
            continue;
        if (d->kind == EPIPE_PARAM_CHOICE)
            snprintf(val, sizeof val, "%s", d->choices[(int)c->p[i]]);
        else if (d->kind == EPIPE_PARAM_INT)
            snprintf(val, sizeof val, "%.0f", c->p[i]);
        else
            format_real(val, sizeof val, c->p[i]);
        len += (size_t)snprintf(c->spec + len, sizeof c->spec - len, "%c%s=%s", first ? ':' : ',',
                                d->key, val);
        first = 0;
    }
    if (c->ef && len < sizeof c->spec) /* ef=0, the default, is left out */
        snprintf(c->spec + len, sizeof c->spec - len, "%cef=1", strchr(c->spec, ':') ? ',' : ':');
    epipe_codec_delta_spec(c);
}

static int parse_params(epipe_codec *c, const char *spec)
{
    size_t total = strlen(spec);
    if (total == 0)
        return epipe_fail(EPIPE_EINVAL, "codec spec is empty");
    if (total >= EPIPE_SPEC_MAX)
        return epipe_fail(EPIPE_EINVAL, "codec spec is %zu characters; the limit is %d", total,
                          EPIPE_SPEC_MAX - 1);
    const char *colon = strchr(spec, ':');
    size_t nlen = colon ? (size_t)(colon - spec) : total;
    const epipe_codec_ops *ops = epipe_codec_find(spec, nlen);
    if (!ops)
        return epipe_codec_unknown(spec, nlen);
    c->ops = ops;
    int set[EPIPE_CODEC_MAX_PARAMS] = {0}, ef_set = 0;
    if (colon) {
        const char *p = colon + 1;
        if (*p == '\0')
            return epipe_fail(EPIPE_EINVAL, "%s: nothing after ':'", ops->name);
        for (;;) {
            const char *comma = strchr(p, ',');
            size_t ilen = comma ? (size_t)(comma - p) : strlen(p);
            const char *eq = memchr(p, '=', ilen);
            if (ilen == 0)
                return epipe_fail(EPIPE_EINVAL, "%s: empty parameter in '%s'", ops->name, spec);
            if (!eq)
                return epipe_fail(EPIPE_EINVAL, "%s: parameter '%.*s' has no '=value'", ops->name,
                                  (int)ilen, p);
            size_t klen = (size_t)(eq - p);
            if (klen == 2 && memcmp(p, "ef", 2) == 0 && epipe_codec_param_index(ops, "ef") < 0) {
                if (ef_set)
                    return epipe_fail(EPIPE_EINVAL, "%s: key 'ef' is given twice", ops->name);
                int rc = parse_ef(c, eq + 1, ilen - klen - 1);
                if (rc)
                    return rc;
                ef_set = 1;
                if (!comma)
                    break;
                p = comma + 1;
                continue;
            }
            int drc = epipe_codec_delta_parse(c, p, klen, eq + 1, ilen - klen - 1);
            if (drc != 1) {
                if (drc)
                    return drc;
                if (!comma)
                    break;
                p = comma + 1;
                continue;
            }
            unsigned k = 0;
            while (k < ops->nparams && !(strlen(ops->params[k].key) == klen &&
                                         memcmp(ops->params[k].key, p, klen) == 0))
                k++;
            if (k == ops->nparams)
                return epipe_fail(EPIPE_EINVAL, "%s: unknown key '%.*s'", ops->name, (int)klen, p);
            if (set[k])
                return epipe_fail(EPIPE_EINVAL, "%s: key '%s' is given twice", ops->name,
                                  ops->params[k].key);
            int rc = parse_value(ops, &ops->params[k], eq + 1, ilen - klen - 1, &c->p[k]);
            if (rc)
                return rc;
            set[k] = 1;
            if (!comma)
                break;
            p = comma + 1;
        }
    }
    for (unsigned k = 0; k < ops->nparams; k++)
        if (!set[k])
            c->p[k] = param_default(c, k);
    if (ops->configure) {
        int rc = ops->configure(c);
        if (rc)
            return rc;
    }
    return epipe_codec_delta_check(c);
}

int epipe_codec_parse_spec(epipe_codec *c, const char *spec)
{
    /* The chain's "|" is the one operator of the grammar; the chain codec
     * parses its links itself (chain.c). */
    if (strchr(spec, '|')) {
        c->ops = &epipe_codec_chain;
        return c->ops->parse(c, spec);
    }
    int rc = parse_params(c, spec);
    if (rc)
        return rc;
    build_canonical_spec(c);
    return EPIPE_OK;
}
