//! `kvx pd` across two real processes over libfabric (shm and tcp): push and pull, heterogeneous
//! TP, block size and memory order; decode verifies every byte. And a decode killed mid-stream:
//! prefill releases every block it held and exits on its own. And the pair on two hosts (two
//! network namespaces), over `libfabric:tcp` with no interface named.

#[path = "support/pair.rs"]
mod pair;

use kvx_testkit::free_ports;
use kvx_testkit::netns::{Host, TwoHosts};
use pair::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn push_over_shm_verifies_every_byte() {
    // Chunked prefill, each chunk layer by layer: the 200-token requests are written in
    // 64-token pieces of layer 0, then of layer 1, while they compute (2 ms per chunk), up to
    // token 192; of the 40-token ones (one chunk), layer 0 up to token 32.
    let (report, _, prefill) = run_pair(&Run {
        transport: "libfabric:shm",
        mode: "push",
        prefill: &["--chunk-tokens", "64", "--per-token-us", "30"],
        decode: &[],
        requests: 8,
        hosts: None,
        tokens: "40,200",
    });
    check(&report, 8, 4 * 40 + 4 * 200);
    // Where `shm`'s writes land by cross-memory attach, decode has a notice board: prefill
    // writes each notice there after the data, and decode's engine loop finds it.
    let cma = kvx_rdma::libfabric::shm_uses_cma();
    assert_eq!(report["summary"]["board_ready"], if cma { 8 } else { 0 });
    assert_eq!(report["summary"]["finishing_hints"], 0);
    // The tiny model has two layers: a 16-token block of one layer is 8 tokens' worth.
    let per_token = report["kv_bytes_per_token"].as_u64().unwrap();
    assert_streamed(&prefill, 8 * per_token, (4 * 192 + 4 * 16) * per_token);
    // Without the board, decode asks for a finishing hint per request (one producer rank) and
    // reads its transport only after each (`shm` polls to wait).
    let (report, _, _) = run_pair(&Run {
        transport: "libfabric:shm",
        mode: "push",
        prefill: &[],
        decode: &["--notice-board", "off"],
        requests: 6,
        hosts: None,
        tokens: "200",
    });
    check(&report, 6, 1200);
    assert_eq!(report["summary"]["board_ready"], 0);
    assert_eq!(
        report["summary"]["finishing_hints"],
        if cma { 6 } else { 0 }
    );
}

#[test]
fn pull_over_shm_verifies_every_byte() {
    let (report, _, _) = run_pair(&Run {
        transport: "libfabric:shm",
        mode: "pull",
        prefill: &[],
        decode: &[],
        requests: 8,
        hosts: None,
        tokens: "40,200",
    });
    check(&report, 8, 4 * 40 + 4 * 200);
}

#[test]
fn pull_over_tcp_verifies_every_byte() {
    // Over `tcp` decode's reads are messages that prefill's transport answers: prefill keeps
    // reading it while it holds blocks for pull (it once did only when another command woke
    // it, so the last request's reads waited for the producer lease).
    // Two warm-up requests first, left out of the measurements (but verified too).
    let (report, _, _) = run_pair(&Run {
        transport: "libfabric:tcp",
        mode: "pull",
        prefill: &[],
        decode: &["--warmup", "2"],
        requests: 4,
        hosts: None,
        tokens: "100",
    });
    check(&report, 4, 400);
    assert_eq!(report["summary"]["warmup_requests"], 2);
    assert_eq!(report["summary"]["warmup_failed"], 0);
    assert_eq!(report["summary"]["ttft_ms"]["n"], 4);
    assert_eq!(report["per_request"].as_array().map(Vec::len), Some(4));
    // A read left waiting would be answered only when decode's next heartbeat (every 5 s)
    // wakes prefill; a healthy read takes milliseconds, so 2 s tells the two apart.
    let critical = report["summary"]["critical_path_ms"]["max"]
        .as_f64()
        .unwrap();
    assert!(
        critical < 2_000.0,
        "a read waited {critical} ms for prefill"
    );
}

#[test]
fn push_over_tcp_verifies_every_byte() {
    // Each request computed in one step, layer by layer: layer 0 (up to token 96) goes while
    // layer 1 computes.
    let (report, _, prefill) = run_pair(&Run {
        transport: "libfabric:tcp",
        mode: "push",
        prefill: &["--chunk-tokens", "0", "--per-token-us", "30"],
        decode: &[],
        requests: 6,
        hosts: None,
        tokens: "100",
    });
    check(&report, 6, 600);
    // `tcp` blocks on a wait descriptor: no hints asked for.
    assert_eq!(report["summary"]["finishing_hints"], 0);
    let per_token = report["kv_bytes_per_token"].as_u64().unwrap();
    assert_streamed(&prefill, 8 * per_token, 6 * 48 * per_token);
}

#[test]
fn push_and_pull_over_cma_verify_every_byte() {
    // Cross-memory attach: prefill's writer copies straight into decode's cache.
    // Chunked prefill on two ranks into another block size and order, whole chunks only (no
    // layer-wise reports): the 300-token requests are written early in 32-token-aligned pieces
    // (96 and 192 tokens), the rest at the end.
    let (report, _, prefill) = run_pair(&Run {
        transport: "cma",
        mode: "push",
        prefill: &[
            "--tp",
            "2",
            "--chunk-tokens",
            "100",
            "--per-token-us",
            "30",
            "--layer-progress",
            "false",
        ],
        decode: &["--block-tokens", "32", "--order", "nhd"],
        requests: 6,
        hosts: None,
        tokens: "40,300",
    });
    check(&report, 6, 3 * 40 + 3 * 300);
    // Another memory order: decode re-lays-out what lands, so the notices come as messages.
    assert_eq!(report["summary"]["board_ready"], 0);
    let per_token = report["kv_bytes_per_token"].as_u64().unwrap();
    assert_streamed(&prefill, 32 * per_token, 3 * 192 * per_token);
    // The same layout on both sides: prefill writes each notice into decode's notice board,
    // which decode's engine loop reads (its driver thread is not woken for it); on or off,
    // every byte arrives.
    for (board, expected) in [("on", 6), ("off", 0)] {
        let (report, _, _) = run_pair(&Run {
            transport: "cma",
            mode: "push",
            prefill: &[],
            decode: &["--notice-board", board],
            requests: 6,
            hosts: None,
            tokens: "200",
        });
        check(&report, 6, 1200);
        assert_eq!(report["summary"]["board_ready"], expected, "board {board}");
    }
    let (report, _, _) = run_pair(&Run {
        transport: "cma",
        mode: "pull",
        prefill: &[],
        decode: &[],
        requests: 6,
        hosts: None,
        tokens: "200",
    });
    check(&report, 6, 1200);
}

/// Two `shm` rails (striped writes posted from a thread per rail) and the dimension-major key
/// order of vLLM's CPU cache on both sides, with different block sizes and TP degrees: push and
/// pull, every byte verified. The requests (400 and 1,000 tokens of 1 KiB) are over the striping
/// threshold.
#[test]
fn two_shm_rails_and_dimension_major_keys_verify_every_byte() {
    for (mode, prefill, decode) in [
        (
            "push",
            &["--order", "hnd-kt", "--tp", "2"][..],
            &["--order", "hnd-kt", "--block-tokens", "32"][..],
        ),
        (
            "pull",
            &["--order", "hnd-kt", "--block-tokens", "32"][..],
            &["--order", "hnd-kt", "--tp", "2"][..],
        ),
    ] {
        let (report, _, _) = run_pair(&Run {
            transport: "libfabric:shm,rails=2",
            mode,
            prefill,
            decode,
            requests: 6,
            hosts: None,
            tokens: "400,1000",
        });
        check(&report, 6, 3 * 400 + 3 * 1000);
    }
}

#[test]
fn heterogeneous_tp_block_size_and_order() {
    // Prefill TP 2, block 16, HND; decode TP 1, block 32, NHD (a receiver re-layout).
    let (report, _, _) = run_pair(&Run {
        transport: "libfabric:shm",
        mode: "push",
        prefill: &["--tp", "2"],
        decode: &["--block-tokens", "32", "--order", "nhd"],
        requests: 6,
        hosts: None,
        tokens: "70",
    });
    check(&report, 6, 420);
    // And the reverse: TP 1 into two decode ranks, push and pull.
    let (report, _, _) = run_pair(&Run {
        transport: "libfabric:shm",
        mode: "push",
        prefill: &["--block-tokens", "32"],
        decode: &["--tp", "2"],
        requests: 4,
        hosts: None,
        tokens: "70",
    });
    check(&report, 4, 280);
    let (report, _, _) = run_pair(&Run {
        transport: "libfabric:shm",
        mode: "pull",
        prefill: &["--block-tokens", "32"],
        decode: &["--tp", "2"],
        requests: 4,
        hosts: None,
        tokens: "70",
    });
    check(&report, 4, 280);
}

#[test]
fn killed_decode_leaves_nothing_held_on_prefill() {
    let kvx = free_ports(1);
    let bench = free_ports(1);
    let prefill = Command::new(kvx_bin())
        .args([
            "pd",
            "prefill",
            "--model",
            "tiny",
            "--blocks",
            "4096",
            "--lease-s",
            "2",
        ])
        .args([
            "--listen",
            &kvx.to_string(),
            "--bench-listen",
            &bench.to_string(),
        ])
        .args(["--per-token-us", "50"])
        // Its log, should it not exit in time, says what it still held.
        .env("RUST_LOG", "warn,kvx_vllm=info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut prefill = Killer::new(prefill);
    let decode = Command::new(kvx_bin())
        .args([
            "pd",
            "decode",
            "--model",
            "tiny",
            "--blocks",
            "4096",
            "--rate",
            "200",
            "--requests",
            "400",
        ])
        .args([
            "--input-tokens",
            "2000",
            "--prefill",
            &kvx.to_string(),
            "--prefill-bench",
            &bench.to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut decode = Killer(decode, None);
    // Kill it once it is running (its start-up can be slow on a loaded machine).
    let stderr = decode.0.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead as _;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if line.contains("running") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("decode never started");
    std::thread::sleep(Duration::from_millis(1500));
    decode.0.kill().unwrap();
    let _ = decode.0.wait();
    // Writes in flight to the dead decode end when the transport gives up on them (shm reports
    // nothing: its 30 s operation timeout bounds the wait); everything else within the lease.
    let status = wait_with_deadline(&mut prefill, Duration::from_secs(90));
    let out = prefill.log();
    assert!(status.success(), "prefill exited with {status}: {out}");
    // "served N requests; per-rank releases: S sent, U not sent" with S + U == N.
    let (line, numbers) = summary_numbers(&out, "served");
    let (served, sent, not_sent) = (numbers[0], numbers[1], numbers[2]);
    assert!(served > 0, "{line}");
    assert_eq!(
        sent + not_sent,
        served,
        "every held request released exactly once: {line}"
    );
}

#[test]
fn raw_transfer_reports_the_requests_bytes() {
    let out = Command::new(kvx_bin())
        .args(["pd", "raw", "--model", "tiny", "--transport", "cma"])
        .args(["--input-tokens", "100", "--repeats", "3"])
        .output()
        .expect("kvx pd raw");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    // tiny: 2 layers × K,V × 4 heads × 16 dims × 4 bytes = 1 KiB per token.
    assert_eq!(v["bytes"], 100 * 1024);
    assert_eq!(v["transport"], "cma");
    assert!(v["transfer_ms_p50"].as_f64().unwrap() > 0.0);
}

#[test]
fn across_two_hosts_over_tcp_push_and_pull_verify_every_byte() {
    across_two_hosts(
        "across_two_hosts_over_tcp_push_and_pull_verify_every_byte",
        "libfabric:tcp",
    );
}

/// NIXL over UCX's TCP transport (the runtime from `KVX_NIXL_LIB_DIR`, as `cargo xtask test`
/// sets it, with `UCX_TLS=tcp`; skipped where it is unset).
#[test]
fn across_two_hosts_over_nixl_push_and_pull_verify_every_byte() {
    let test = "across_two_hosts_over_nixl_push_and_pull_verify_every_byte";
    if std::env::var_os("KVX_NIXL_LIB_DIR").is_none() {
        println!("SKIPPED {test}: KVX_NIXL_LIB_DIR is unset (cargo xtask test sets it)");
        return;
    }
    across_two_hosts(test, "nixl");
}

/// `kvx pd` push and pull with prefill and decode on two hosts over `transport`, which names no
/// interface: each side must pick the one the other reaches.
fn across_two_hosts(test: &str, transport: &str) {
    let Some(hosts) = TwoHosts::for_test(test) else {
        return;
    };
    // Prefill listens on the network: the pair shares a deployment key.
    let key = keygen(&format!("{test}-{transport}"));
    let keyed = ["--auth-key-file", key.to_str().unwrap()];
    for mode in ["push", "pull"] {
        let (report, decode, prefill) = run_pair(&Run {
            transport,
            mode,
            prefill: &keyed,
            decode: &keyed,
            requests: 4,
            hosts: Some(&hosts),
            tokens: "100",
        });
        check_delivery(&report, 4, 400);
        let s = &report["summary"];
        // Nothing took a same-host path: the control connections are TCP, and each side's
        // endpoint opened on its veth interface (not `lo`, which the other host cannot reach).
        assert_eq!(s["local_connections"], 0, "{s}");
        let decode_err = String::from_utf8_lossy(&decode.stderr);
        for (side, log, addr) in [
            ("prefill", prefill.as_str(), hosts.addr(Host::A)),
            ("decode", &*decode_err, hosts.addr(Host::B)),
        ] {
            let line = log
                .lines()
                .find(|l| l.contains("tcp endpoint interface chosen"))
                .unwrap_or_else(|| panic!("{transport} {mode}: {side} logged no interface: {log}"));
            assert!(
                line.contains("interface=kx") && line.contains(&addr.to_string()),
                "{transport} {mode}: {side} opened on the wrong interface: {line}"
            );
        }
    }
}

/// Prefill and decode with different transports: decode's first contact fails every request at
/// once with an error that names both transports (no request waits for a timeout).
#[test]
fn mismatched_transports_fail_at_the_handshake_naming_both() {
    for (prefill_transport, decode_transport, theirs, ours) in [
        (
            "libfabric:shm",
            "libfabric:tcp",
            "libfabric/shm",
            "libfabric/tcp;ofi_rxm",
        ),
        ("cma", "libfabric:shm", "cma/", "libfabric/shm"),
    ] {
        let kvx = free_ports(1);
        let bench = free_ports(1);
        let prefill = Command::new(kvx_bin())
            .args(["pd", "prefill", "--model", "tiny", "--blocks", "64"])
            .args(["--transport", prefill_transport])
            .args(["--listen", &kvx.to_string()])
            .args(["--bench-listen", &bench.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let _prefill = Killer::new(prefill);
        let started = Instant::now();
        let decode = Command::new(kvx_bin())
            .args(["pd", "decode", "--model", "tiny", "--blocks", "64"])
            .args(["--transport", decode_transport])
            .args(["--prefill", &kvx.to_string()])
            .args(["--prefill-bench", &bench.to_string()])
            .args(["--requests", "2", "--rate", "50", "--input-tokens", "20"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&decode.stderr);
        assert!(!decode.status.success(), "{err}");
        let want = format!("moves KV over {theirs} but this side over {ours}");
        assert!(err.contains(&want), "no `{want}` in: {err}");
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the mismatch took {:?} to surface",
            started.elapsed()
        );
    }
}

/// A new deployment key made by `kvx keygen`, in a fresh folder named after `name`.
fn keygen(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvx-keys-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("key");
    let out = Command::new(kvx_bin())
        .args(["keygen", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    path
}

/// With a deployment key on both sides, push and pull verify every byte (the control
/// connections, Unix sockets here, are authenticated and encrypted); a decode with another key
/// fails and says why; `kvx keygen` never overwrites a key; and a prefill that would listen on
/// the network without a key does not start.
#[test]
fn with_a_deployment_key_push_and_pull_verify_and_another_key_is_refused() {
    use std::os::unix::fs::PermissionsExt as _;
    let key = keygen("auth");
    let other = keygen("auth-other");
    let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let again = Command::new(kvx_bin())
        .args(["keygen", key.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!again.status.success());
    let keyed = ["--auth-key-file", key.to_str().unwrap()];
    for mode in ["push", "pull"] {
        let (report, _, _) = run_pair(&Run {
            transport: "libfabric:shm",
            mode,
            prefill: &keyed,
            decode: &keyed,
            requests: 4,
            tokens: "100",
            hosts: None,
        });
        check(&report, 4, 400);
    }
    // Decode with another key: its requests fail, naming the key; prefill refuses it.
    let kvx = free_ports(1);
    let bench = free_ports(1);
    let model = ["--model", "tiny", "--blocks", "64"];
    let prefill = Command::new(kvx_bin())
        .args(["pd", "prefill"])
        .args(model)
        .args(keyed)
        .args(["--listen", &kvx.to_string()])
        .args(["--bench-listen", &bench.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut prefill = Killer::new(prefill);
    let decode = Command::new(kvx_bin())
        .args(["pd", "decode"])
        .args(model)
        .args(["--auth-key-file", other.to_str().unwrap()])
        .args(["--prefill", &kvx.to_string()])
        .args(["--prefill-bench", &bench.to_string()])
        .args(["--requests", "2", "--rate", "40", "--output-tokens", "2"])
        .args(["--step-ms", "1", "--lease-s", "5"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&decode.stderr);
    assert!(!decode.status.success(), "{stderr}");
    assert!(stderr.contains("deployment key"), "{stderr}");
    let status = wait_with_deadline(&mut prefill, Duration::from_secs(30));
    let log = prefill.log();
    assert!(status.success(), "{log}");
    assert!(log.contains("refused a control connection"), "{log}");
    // A prefill on the network without a key does not start, and says how to make one.
    let open = Command::new(kvx_bin())
        .args(["pd", "prefill"])
        .args(model)
        .args([
            "--listen",
            "0.0.0.0:0",
            "--bench-listen",
            &free_ports(1).to_string(),
        ])
        .env_remove("KVX_AUTH_KEY_FILE")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&open.stderr);
    assert!(!open.status.success(), "{said}");
    assert!(said.contains("kvx keygen"), "{said}");
    // Key files that cannot be used stop the start, saying why.
    let dir = key.parent().unwrap();
    let loose = dir.join("loose");
    std::fs::copy(&key, &loose).unwrap();
    std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o644)).unwrap();
    let short = dir.join("short");
    std::fs::write(&short, [7u8; 31]).unwrap();
    std::fs::set_permissions(&short, std::fs::Permissions::from_mode(0o600)).unwrap();
    for (file, says) in [
        (dir.join("missing"), "cannot read the kvx key file"),
        (loose, "chmod 600"),
        (short, "holds 31 bytes"),
    ] {
        let out = Command::new(kvx_bin())
            .args(["pd", "prefill"])
            .args(model)
            .args(["--auth-key-file", file.to_str().unwrap()])
            .args(["--listen", &free_ports(1).to_string()])
            .args(["--bench-listen", &free_ports(1).to_string()])
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{said}");
        assert!(said.contains(says), "{file:?}: {said}");
    }
}

/// With `--otlp-endpoint`, decode (the pair's router) starts a trace per request and hands it
/// on: each request is one trace across the two processes, decode's `kvx.pd.request` span the
/// parent of prefill's `kvx.send` and decode's `kvx.receive` spans, push and pull; every span
/// posted before the processes end.
#[test]
fn a_traced_pair_exports_each_request_as_one_trace_across_both_processes() {
    use kvx_testkit::otlp::{field, receiver, spans_named};
    for mode in ["push", "pull"] {
        let (endpoint, posted) = receiver();
        let otlp = ["--otlp-endpoint", endpoint.as_str()];
        let (report, _, _) = run_pair(&Run {
            transport: "cma",
            mode,
            prefill: &otlp,
            decode: &otlp,
            requests: 3,
            hosts: None,
            tokens: "40,100",
        });
        check(&report, 3, 40 + 100 + 40);
        let routers = spans_named(&posted, "kvx.pd.request");
        let sends = spans_named(&posted, "kvx.send");
        let receives = spans_named(&posted, "kvx.receive");
        assert_eq!(routers.len(), 3, "{mode}: {routers:?}");
        for router in &routers {
            let trace = field(router, "traceId").expect("a trace id");
            let id = field(router, "spanId").expect("a span id");
            assert_eq!(field(router, "parentSpanId"), Some(""), "{router}");
            for (side, spans) in [("prefill", &sends), ("decode", &receives)] {
                let children: Vec<&String> = spans
                    .iter()
                    .filter(|s| field(s, "traceId") == Some(trace))
                    .collect();
                assert_eq!(children.len(), 1, "{mode}, {side}: {trace} in {spans:?}");
                assert_eq!(
                    field(children[0], "parentSpanId"),
                    Some(id),
                    "{mode}, {side}"
                );
            }
        }
    }
}
