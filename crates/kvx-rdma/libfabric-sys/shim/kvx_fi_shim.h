/*
 * kvx libfabric shim: real, linkable functions for the calls that <rdma/fabric.h> and friends
 * declare as static inline (they dispatch through the provider's ops tables, so Rust cannot call
 * them directly). Every function forwards its arguments unchanged.
 *
 * Nothing links libfabric: kvx_fi_load opens the shared library at run time (dlopen) and binds
 * the few calls it exports itself (fi_getinfo, fi_freeinfo, fi_dupinfo, fi_fabric, fi_version,
 * fi_strerror), which the kvx_fi_* functions below call through. A program built with libfabric
 * support so starts, and uses its other transports, where libfabric is not installed.
 */
#ifndef KVX_FI_SHIM_H
#define KVX_FI_SHIM_H

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

/*
 * Opens the libfabric shared library `path` (a file name such as "libfabric.so.1" is searched
 * for as the dynamic loader does) and binds the calls it exports. Returns 0, or -1 with why in
 * `err` (at most `err_len` bytes, NUL-terminated). Once loaded, later calls return 0 at once
 * and the library stays loaded for the life of the process. Callers serialise the calls.
 */
int kvx_fi_load(const char *path, char *err, size_t err_len);
/* Whether kvx_fi_load has succeeded: no other call of this shim may be made before. */
int kvx_fi_loaded(void);

/* The calls libfabric exports, through the loaded library. */
int kvx_fi_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
                   const struct fi_info *hints, struct fi_info **info);
void kvx_fi_freeinfo(struct fi_info *info);
struct fi_info *kvx_fi_dupinfo(const struct fi_info *info);
uint32_t kvx_fi_version(void);
const char *kvx_fi_strerror(int errnum);

/* FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION) of the headers this crate was built against. */
uint32_t kvx_fi_header_version(void);
/* FI_VERSION(major, minor). */
uint32_t kvx_fi_make_version(uint32_t major, uint32_t minor);

struct fi_info *kvx_fi_allocinfo(void);
int kvx_fi_close(struct fid *fid);

int kvx_fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context);
int kvx_fi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain,
                  void *context);
int kvx_fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep,
                    void *context);
int kvx_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq,
                   void *context);
int kvx_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av,
                   void *context);
int kvx_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags);
int kvx_fi_enable(struct fid_ep *ep);
int kvx_fi_getname(fid_t fid, void *addr, size_t *addrlen);
int kvx_fi_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr,
                     uint64_t flags, void *context);
int kvx_fi_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count, uint64_t flags);

int kvx_fi_mr_regattr(struct fid_domain *domain, const struct fi_mr_attr *attr, uint64_t flags,
                      struct fid_mr **mr);
void *kvx_fi_mr_desc(struct fid_mr *mr);
uint64_t kvx_fi_mr_key(struct fid_mr *mr);
int kvx_fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags);
int kvx_fi_mr_enable(struct fid_mr *mr);

ssize_t kvx_fi_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags);
ssize_t kvx_fi_readmsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags);
ssize_t kvx_fi_sendmsg(struct fid_ep *ep, const struct fi_msg *msg, uint64_t flags);
ssize_t kvx_fi_recvmsg(struct fid_ep *ep, const struct fi_msg *msg, uint64_t flags);

ssize_t kvx_fi_cq_read(struct fid_cq *cq, void *buf, size_t count);
ssize_t kvx_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags);
ssize_t kvx_fi_cq_sread(struct fid_cq *cq, void *buf, size_t count, const void *cond,
                        int timeout);
int kvx_fi_cq_signal(struct fid_cq *cq);
const char *kvx_fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data,
                               char *buf, size_t len);

#endif /* KVX_FI_SHIM_H */
