//! Whether libfabric's `shm` provider moves RMA data with cross-memory attach here: then the
//! initiator copies a write into the target's memory itself (`shm`'s fast RMA), and the target
//! need not read its completion queue for the data to land. `shm` decides per peer with a probe
//! of its own; this is the same judgement made once per process, from what decides it: its
//! `FI_SHM_DISABLE_CMA` switch, Yama's `ptrace_scope` (`shm` declares any process of the user as
//! its tracer, which covers scope 1), and whether the kernel and seccomp allow the call at all.

/// Whether `shm` moves RMA data by cross-memory attach in this process (the judgement each
/// `shm` endpoint makes when it opens; exported as `shm_uses_cma`).
#[must_use]
pub fn cma_usable() -> bool {
    decide(
        std::env::var("FI_SHM_DISABLE_CMA").ok().as_deref(),
        std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
            .ok()
            .as_deref(),
        probe_own_memory,
    )
}

/// `disable`: the value of `FI_SHM_DISABLE_CMA`; `ptrace_scope`: Yama's setting (`None` without
/// Yama); `probe`: whether a cross-memory read works at all.
fn decide(disable: Option<&str>, ptrace_scope: Option<&str>, probe: impl FnOnce() -> bool) -> bool {
    // libfabric reads boolean parameters as 1/true/yes/on (any case).
    let disabled = disable.is_some_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    });
    let scope_allows = ptrace_scope.is_none_or(|s| s.trim().parse::<u32>().is_ok_and(|s| s <= 1));
    !disabled && scope_allows && probe()
}

/// Reads 8 bytes of this process's own memory with `process_vm_readv`.
fn probe_own_memory() -> bool {
    let source = [0x5a_u8; 8];
    let mut target = [0_u8; 8];
    let local = libc::iovec {
        iov_base: target.as_mut_ptr().cast(),
        iov_len: target.len(),
    };
    let remote = libc::iovec {
        iov_base: source.as_ptr().cast_mut().cast(),
        iov_len: source.len(),
    };
    // SAFETY: both iovecs describe live 8-byte buffers of this process (the remote one is only
    // read), and the call writes at most `target.len()` bytes into `target`.
    let copied = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    copied == 8 && target == source
}

#[cfg(test)]
mod tests {
    use super::decide;

    #[test]
    fn the_switch_the_ptrace_scope_and_the_probe_all_decide() {
        let works = || true;
        assert!(decide(None, None, works));
        assert!(decide(Some("0"), Some("1\n"), works));
        assert!(decide(None, Some("0"), works));
        for switch in ["1", "true", "YES", " on "] {
            assert!(!decide(Some(switch), None, works), "{switch}");
        }
        assert!(!decide(None, Some("2"), works));
        assert!(!decide(None, Some("3\n"), works));
        assert!(!decide(None, Some("garbled"), works));
        assert!(!decide(None, None, || false));
    }
}
