/* libibverbs opened at run time (dlopen + dlvsym by version), so libepipe
 * loads on machines without it, and the device/port probe of the rdma transport. */
#ifndef EPIPE_TRANSPORT_RDMA_VERBS_H
#define EPIPE_TRANSPORT_RDMA_VERBS_H

#include <infiniband/verbs.h>
#include <stddef.h>

/* The control-path calls the transport uses, resolved from the library
 * (IBVERBS_1.1, or IBVERBS_1.0 where only that exists). The data path
 * (post_send, post_recv, poll_cq, req_notify_cq) goes through the
 * context's ops table, as verbs.h's inline functions do. */
typedef struct epipe_verbs {
    void *lib;
    char path[256];
    struct ibv_device **(*get_device_list)(int *);
    void (*free_device_list)(struct ibv_device **);
    const char *(*get_device_name)(struct ibv_device *);
    struct ibv_context *(*open_device)(struct ibv_device *);
    int (*close_device)(struct ibv_context *);
    int (*query_device)(struct ibv_context *, struct ibv_device_attr *);
    int (*query_port)(struct ibv_context *, uint8_t, struct ibv_port_attr *);
    int (*query_gid)(struct ibv_context *, uint8_t, int, union ibv_gid *);
    struct ibv_pd *(*alloc_pd)(struct ibv_context *);
    int (*dealloc_pd)(struct ibv_pd *);
    struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
    int (*dereg_mr)(struct ibv_mr *);
    struct ibv_comp_channel *(*create_comp_channel)(struct ibv_context *);
    int (*destroy_comp_channel)(struct ibv_comp_channel *);
    struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int);
    int (*destroy_cq)(struct ibv_cq *);
    int (*get_cq_event)(struct ibv_comp_channel *, struct ibv_cq **, void **);
    void (*ack_cq_events)(struct ibv_cq *, unsigned int);
    struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
    int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
    int (*destroy_qp)(struct ibv_qp *);
    const char *(*wc_status_str)(enum ibv_wc_status);
} epipe_verbs;

/* Opens the library (EPIPE_IBVERBS_LIB, else libibverbs.so.1) and resolves
 * every call. EPIPE_ENOTSUP naming the library and the missing symbol; the
 * error is set. On failure nothing stays open. */
int epipe_verbs_open(epipe_verbs *v);
void epipe_verbs_close(epipe_verbs *v);

/* An opened device with an active port: what the transport needs of it. */
typedef struct epipe_verbs_dev {
    struct ibv_context *ctx;
    char name[64];
    uint8_t port;
    struct ibv_port_attr port_attr;
    union ibv_gid gid;
    int gid_index;
    uint32_t max_mr; /* device limits, for the registration cache */
} epipe_verbs_dev;

/* Opens the first device (or EPIPE_RDMA_DEVICE) and checks port 1 (or
 * EPIPE_RDMA_PORT) is active. EPIPE_ENOTSUP naming which is missing: no
 * device, the named device absent, the port down or not queryable. */
int epipe_verbs_probe(const epipe_verbs *v, epipe_verbs_dev *d);
void epipe_verbs_release(const epipe_verbs *v, epipe_verbs_dev *d);

/* The text of a completion status (the library's, or the enum number). */
const char *epipe_verbs_status(const epipe_verbs *v, enum ibv_wc_status s, char *buf, size_t cap);

#endif
