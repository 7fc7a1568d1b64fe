/* See kvx_fi_shim.h. */
#include "kvx_fi_shim.h"

/* The Rust side defines these members of an anonymous enum by value; keep them honest. */
_Static_assert(FI_EOTHER == 256, "FI_EOTHER changed");
_Static_assert(FI_ETOOSMALL == 257, "FI_ETOOSMALL changed");
_Static_assert(FI_EOPBADSTATE == 258, "FI_EOPBADSTATE changed");
_Static_assert(FI_EAVAIL == 259, "FI_EAVAIL changed");

uint32_t kvx_fi_header_version(void) { return FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION); }
uint32_t kvx_fi_make_version(uint32_t major, uint32_t minor) { return FI_VERSION(major, minor); }

struct fi_info *kvx_fi_allocinfo(void) { return fi_allocinfo(); }
int kvx_fi_close(struct fid *fid) { return fi_close(fid); }

int kvx_fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context)
{
	return fi_fabric(attr, fabric, context);
}

int kvx_fi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain,
		  void *context)
{
	return fi_domain(fabric, info, domain, context);
}

int kvx_fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep,
		    void *context)
{
	return fi_endpoint(domain, info, ep, context);
}

int kvx_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq,
		   void *context)
{
	return fi_cq_open(domain, attr, cq, context);
}

int kvx_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av,
		   void *context)
{
	return fi_av_open(domain, attr, av, context);
}

int kvx_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags)
{
	return fi_ep_bind(ep, bfid, flags);
}

int kvx_fi_enable(struct fid_ep *ep) { return fi_enable(ep); }

int kvx_fi_getname(fid_t fid, void *addr, size_t *addrlen) { return fi_getname(fid, addr, addrlen); }

int kvx_fi_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr,
		     uint64_t flags, void *context)
{
	return fi_av_insert(av, addr, count, fi_addr, flags, context);
}

int kvx_fi_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count, uint64_t flags)
{
	return fi_av_remove(av, fi_addr, count, flags);
}

int kvx_fi_mr_regattr(struct fid_domain *domain, const struct fi_mr_attr *attr, uint64_t flags,
		      struct fid_mr **mr)
{
	return fi_mr_regattr(domain, attr, flags, mr);
}

void *kvx_fi_mr_desc(struct fid_mr *mr) { return fi_mr_desc(mr); }
uint64_t kvx_fi_mr_key(struct fid_mr *mr) { return fi_mr_key(mr); }
int kvx_fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags)
{
	return fi_mr_bind(mr, bfid, flags);
}
int kvx_fi_mr_enable(struct fid_mr *mr) { return fi_mr_enable(mr); }

ssize_t kvx_fi_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags)
{
	return fi_writemsg(ep, msg, flags);
}

ssize_t kvx_fi_readmsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags)
{
	return fi_readmsg(ep, msg, flags);
}

ssize_t kvx_fi_sendmsg(struct fid_ep *ep, const struct fi_msg *msg, uint64_t flags)
{
	return fi_sendmsg(ep, msg, flags);
}

ssize_t kvx_fi_recvmsg(struct fid_ep *ep, const struct fi_msg *msg, uint64_t flags)
{
	return fi_recvmsg(ep, msg, flags);
}

ssize_t kvx_fi_cq_read(struct fid_cq *cq, void *buf, size_t count)
{
	return fi_cq_read(cq, buf, count);
}

ssize_t kvx_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags)
{
	return fi_cq_readerr(cq, buf, flags);
}

ssize_t kvx_fi_cq_sread(struct fid_cq *cq, void *buf, size_t count, const void *cond, int timeout)
{
	return fi_cq_sread(cq, buf, count, cond, timeout);
}

int kvx_fi_cq_signal(struct fid_cq *cq) { return fi_cq_signal(cq); }

const char *kvx_fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data, char *buf,
			       size_t len)
{
	return fi_cq_strerror(cq, prov_errno, err_data, buf, len);
}
