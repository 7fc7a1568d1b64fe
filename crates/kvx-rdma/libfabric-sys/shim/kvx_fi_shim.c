/* See kvx_fi_shim.h. */

/*
 * The calls libfabric exports go through the pointers kvx_fi_load binds: the headers' own
 * declarations (and the static-inline calls that use them, such as fi_allocinfo) are renamed to
 * this file's forwarding functions, so that nothing here refers to a libfabric symbol.
 */
#define fi_getinfo kvx_dl_fi_getinfo
#define fi_freeinfo kvx_dl_fi_freeinfo
#define fi_dupinfo kvx_dl_fi_dupinfo
#define fi_fabric kvx_dl_fi_fabric
#define fi_version kvx_dl_fi_version
#define fi_strerror kvx_dl_fi_strerror

#include "kvx_fi_shim.h"

#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

static struct {
	int (*getinfo)(uint32_t, const char *, const char *, uint64_t, const struct fi_info *,
		       struct fi_info **);
	void (*freeinfo)(struct fi_info *);
	struct fi_info *(*dupinfo)(const struct fi_info *);
	int (*fabric)(struct fi_fabric_attr *, struct fid_fabric **, void *);
	uint32_t (*version)(void);
	const char *(*strerror)(int);
} lib;

static int loaded;

/*
 * The standard signals (below 32). Opening libfabric runs its libraries' constructors, and one
 * of them replaces the program's handlers: Debian's libfabric links libinfinipath (the PSM
 * provider's library), whose constructor takes SIGSEGV, SIGBUS, SIGTERM, SIGINT, SIGABRT and
 * SIGILL to print a backtrace and exit, so that an engine that shuts down in order on SIGTERM
 * (vLLM's) died at once instead. The handlers are put back as they were before the load.
 * Real-time signals are left as the libraries set them (one may take one for its timers), and so
 * are the handlers libfabric's shm provider installs later, when an endpoint opens (they clean
 * up its shared memory and then call the handler they replaced).
 */
#define KVX_STANDARD_SIGNALS 32

static void keep_handlers(struct sigaction *saved, int *have)
{
	for (int sig = 1; sig < KVX_STANDARD_SIGNALS; sig++)
		have[sig] = sigaction(sig, NULL, &saved[sig]) == 0;
}

static void put_back_handlers(const struct sigaction *saved, const int *have)
{
	for (int sig = 1; sig < KVX_STANDARD_SIGNALS; sig++) {
		struct sigaction now;
		if (!have[sig] || sig == SIGKILL || sig == SIGSTOP || sigaction(sig, NULL, &now) != 0)
			continue;
		if (memcmp(&now.sa_handler, &saved[sig].sa_handler, sizeof(now.sa_handler)) != 0 ||
		    now.sa_flags != saved[sig].sa_flags)
			sigaction(sig, &saved[sig], NULL);
	}
}

int kvx_fi_load(const char *path, char *err, size_t err_len)
{
	if (loaded)
		return 0;
	struct sigaction saved[KVX_STANDARD_SIGNALS];
	int have[KVX_STANDARD_SIGNALS] = {0};
	keep_handlers(saved, have);
	void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	put_back_handlers(saved, have);
	if (!handle) {
		snprintf(err, err_len, "%s", dlerror());
		return -1;
	}
	/* dlsym returns void *; POSIX guarantees it converts to a function pointer. */
#define KVX_BIND(field, name)                                                             \
	do {                                                                              \
		*(void **)&lib.field = dlsym(handle, name);                               \
		if (!lib.field) {                                                         \
			snprintf(err, err_len, "%s exports no %s", path, name);           \
			dlclose(handle);                                                  \
			return -1;                                                        \
		}                                                                         \
	} while (0)
	KVX_BIND(getinfo, "fi_getinfo");
	KVX_BIND(freeinfo, "fi_freeinfo");
	KVX_BIND(dupinfo, "fi_dupinfo");
	KVX_BIND(fabric, "fi_fabric");
	KVX_BIND(version, "fi_version");
	KVX_BIND(strerror, "fi_strerror");
#undef KVX_BIND
	loaded = 1;
	return 0;
}

int kvx_fi_loaded(void) { return loaded; }

int kvx_dl_fi_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
		      const struct fi_info *hints, struct fi_info **info)
{
	return lib.getinfo(version, node, service, flags, hints, info);
}
void kvx_dl_fi_freeinfo(struct fi_info *info) { lib.freeinfo(info); }
struct fi_info *kvx_dl_fi_dupinfo(const struct fi_info *info) { return lib.dupinfo(info); }
int kvx_dl_fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context)
{
	return lib.fabric(attr, fabric, context);
}
uint32_t kvx_dl_fi_version(void) { return lib.version(); }
const char *kvx_dl_fi_strerror(int errnum)
{
	return loaded ? lib.strerror(errnum) : "libfabric is not loaded";
}

int kvx_fi_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
		   const struct fi_info *hints, struct fi_info **info)
{
	return fi_getinfo(version, node, service, flags, hints, info);
}
void kvx_fi_freeinfo(struct fi_info *info) { fi_freeinfo(info); }
struct fi_info *kvx_fi_dupinfo(const struct fi_info *info) { return fi_dupinfo(info); }
uint32_t kvx_fi_version(void) { return fi_version(); }
const char *kvx_fi_strerror(int errnum) { return fi_strerror(errnum); }

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
