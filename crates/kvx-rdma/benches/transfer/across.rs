//! The transfer benchmark across two hosts: the consumer endpoint in one network namespace, the
//! producer in another, joined by a veth pair (`kvx_testkit::netns`), each a child process of
//! the benchmark (this binary run again with [`ROLE_ENV`]). The producer times each transfer
//! from `write` until the consumer's answer to its notice came back (one small control message
//! over the same transport): a round trip more than the one-process figures, whose consumer sees
//! the notice itself. Backends: libfabric `tcp` and NIXL over UCX's `tcp`, both on the veth
//! interface.

use std::io::{BufRead, BufReader, Write as _};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvx_layout::CopyOp;
use kvx_rdma::{EndpointDesc, Event, HostBuffer, LocalRegion, Notice, Transport};
use kvx_testkit::netns::{Host, TwoHosts};

use super::{request_plan, sweep_plan, Memcpy, Row, MIB, PLAN_BLOCKS, PLAN_CHUNK, PLAN_LAYERS};
use super::{PLAN_RUN, SWEEP_BYTES};

/// `consumer:BACKEND` or `producer:BACKEND` in a child process.
pub(crate) const ROLE_ENV: &str = "KVX_TRANSFER_ROLE";
/// The consumer's description (hex), for the producer.
const PEER_ENV: &str = "KVX_TRANSFER_PEER";

/// Sweep sizes across hosts.
const SIZES: [u64; 3] = [64 << 10, MIB, 16 * MIB];
/// The sweep's region index (the plan's are 0..PLAN_LAYERS).
const SWEEP_REGION: u32 = PLAN_LAYERS;

/// The backends measured across hosts.
pub(crate) fn backends() -> Vec<&'static str> {
    let mut out = Vec::new();
    if cfg!(feature = "libfabric") {
        out.push("libfabric-tcp");
    }
    #[cfg(feature = "nixl")]
    if std::env::var_os(kvx_rdma::nixl::LIB_DIR_ENV).is_some() {
        out.push("nixl-ucx-tcp");
    }
    out
}

/// The interface of this namespace's end of the link.
fn link_interface() -> Option<String> {
    kvx_rdma::netif::interfaces()
        .ok()?
        .into_iter()
        .find(|(name, addr)| name != "lo" && addr.is_ipv4())
        .map(|(name, _)| name)
}

/// An endpoint of `backend` on the link interface.
#[cfg_attr(
    not(any(feature = "libfabric", feature = "nixl")),
    allow(unused_variables)
)]
fn open(backend: &str) -> Result<Box<dyn Transport>, String> {
    let interface = link_interface().ok_or("no interface besides loopback")?;
    match backend {
        #[cfg(feature = "libfabric")]
        "libfabric-tcp" => {
            use kvx_rdma::libfabric::{LibfabricConfig, LibfabricTransport};
            LibfabricTransport::open(&LibfabricConfig::tcp(Some(&interface)))
                .map(|t| Box::new(t) as Box<dyn Transport>)
                .map_err(|e| e.to_string())
        }
        #[cfg(feature = "nixl")]
        "nixl-ucx-tcp" => {
            use kvx_rdma::nixl::{NixlConfig, NixlTransport, LIB_DIR_ENV};
            let config = NixlConfig {
                library: std::env::var_os(LIB_DIR_ENV).map(Into::into),
                ..NixlConfig::ucx_tcp(Some(&interface))
            };
            NixlTransport::open(&config)
                .map(|t| Box::new(t) as Box<dyn Transport>)
                .map_err(|e| e.to_string())
        }
        other => Err(format!("{other} is not measured across hosts")),
    }
}

/// Both sides' regions: the plan's layers, then the sweep's.
fn register(t: &mut dyn Transport) -> Result<Vec<Arc<HostBuffer>>, String> {
    let mut buffers = Vec::new();
    let lens = (0..PLAN_LAYERS)
        .map(|_| 2 * PLAN_BLOCKS * PLAN_CHUNK)
        .chain([SWEEP_BYTES]);
    for (index, len) in (0..).zip(lens) {
        let buffer = Arc::new(HostBuffer::new(len as usize).map_err(|e| e.to_string())?);
        buffer.fill_with(|i| i as u8);
        t.register(LocalRegion::host(index, Arc::clone(&buffer)))
            .map_err(|e| e.to_string())?;
        buffers.push(buffer);
    }
    Ok(buffers)
}

fn line(text: &str) {
    println!("{text}");
    let _ = std::io::stdout().flush();
}

/// A child's part (`role` from [`ROLE_ENV`]).
pub(crate) fn child(role: &str) -> Result<(), String> {
    let (side, backend) = role.split_once(':').ok_or("bad role")?;
    let mut t = open(backend)?;
    let _buffers = register(t.as_mut())?;
    line(&format!("DESC {}", t.local_desc().to_hex()));
    let mut stdin = BufReader::new(std::io::stdin()).lines();
    let mut events = Vec::new();
    if side == "consumer" {
        // Connects to the producer for its answers, then answers each notice with its value.
        let producer = stdin
            .next()
            .ok_or("no producer")?
            .map_err(|e| e.to_string())?;
        let producer = EndpointDesc::from_hex(producer.trim()).map_err(|e| e.to_string())?;
        let peer = t.connect(&producer).map_err(|e| e.to_string())?;
        line("READY");
        loop {
            events.clear();
            t.wait(&mut events, Duration::from_millis(20))
                .map_err(|e| e.to_string())?;
            for event in &events {
                if let Event::Notice(Notice(n)) = event {
                    t.send(peer, &n.to_le_bytes()).map_err(|e| e.to_string())?;
                }
            }
        }
    }
    let consumer = std::env::var(PEER_ENV).map_err(|_| "no consumer description")?;
    let consumer = EndpointDesc::from_hex(&consumer).map_err(|e| e.to_string())?;
    let peer = t.connect(&consumer).map_err(|e| e.to_string())?;
    // Waits for the consumer to have connected back.
    stdin.next().ok_or("no go")?.map_err(|e| e.to_string())?;
    let mut notice = 0u64;
    let mut transfer =
        |t: &mut Box<dyn Transport>, plan: &[CopyOp]| -> Result<(f64, f64), String> {
            notice += 1;
            let start = Instant::now();
            t.write(peer, plan, Some(Notice(notice)))
                .map_err(|e| e.to_string())?;
            let posted = start.elapsed().as_secs_f64();
            let deadline = start + Duration::from_secs(120);
            loop {
                events.clear();
                t.wait(&mut events, Duration::from_millis(5))
                    .map_err(|e| e.to_string())?;
                for event in &events {
                    match event {
                        Event::Message(m) if m.as_slice() == notice.to_le_bytes() => {
                            return Ok((start.elapsed().as_secs_f64(), posted));
                        }
                        Event::Failed { error, .. } => return Err(error.to_string()),
                        _ => {}
                    }
                }
                if Instant::now() > deadline {
                    return Err("no answer within 120 s".into());
                }
            }
        };
    let sweep = |size| -> Vec<CopyOp> {
        sweep_plan(size)
            .into_iter()
            .map(|op| CopyOp {
                src_region: SWEEP_REGION,
                dst_region: SWEEP_REGION,
                ..op
            })
            .collect()
    };
    let cases: Vec<(String, u64, Vec<CopyOp>)> = SIZES
        .iter()
        .map(|&size| ("sweep".to_string(), size, sweep(size)))
        .chain([(
            "request-16k".to_string(),
            PLAN_RUN * PLAN_CHUNK,
            request_plan(PLAN_LAYERS, PLAN_CHUNK, PLAN_RUN),
        )])
        .collect();
    for (case, op_bytes, plan) in cases {
        transfer(&mut t, &plan)?;
        let mut best = (f64::INFINITY, 0.0);
        for _ in 0..3 {
            let took = transfer(&mut t, &plan)?;
            if took.0 < best.0 {
                best = took;
            }
        }
        line(&format!(
            "ROW {case} {op_bytes} {} {} {} {}",
            plan.len(),
            plan.iter().map(CopyOp::bytes).sum::<u64>(),
            best.0,
            best.1
        ));
    }
    Ok(())
}

/// Kills a child when dropped.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `backend` across two hosts and returns its rows (with memcpy baselines measured here).
pub(crate) fn measure(hosts: &TwoHosts, backend: &str) -> Result<Vec<Row>, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let spawn = |host, role: String, peer: Option<&str>| -> Result<Reaped, String> {
        let mut command = hosts.command(host, &exe);
        command
            .env(ROLE_ENV, role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if let Some(peer) = peer {
            command.env(PEER_ENV, peer);
        }
        command.spawn().map(Reaped).map_err(|e| e.to_string())
    };
    let desc_of = |lines: &mut std::io::Lines<BufReader<std::process::ChildStdout>>| {
        lines
            .find_map(|l| l.ok()?.strip_prefix("DESC ").map(str::to_owned))
            .ok_or_else(|| format!("{backend}: a side exited before describing itself"))
    };
    let mut consumer = spawn(Host::B, format!("consumer:{backend}"), None)?;
    let mut consumer_out = BufReader::new(consumer.0.stdout.take().ok_or("no stdout")?).lines();
    let consumer_desc = desc_of(&mut consumer_out)?;
    let mut producer = spawn(Host::A, format!("producer:{backend}"), Some(&consumer_desc))?;
    let mut producer_out = BufReader::new(producer.0.stdout.take().ok_or("no stdout")?).lines();
    let producer_desc = desc_of(&mut producer_out)?;
    let mut consumer_in = consumer.0.stdin.take().ok_or("no stdin")?;
    writeln!(consumer_in, "{producer_desc}").map_err(|e| e.to_string())?;
    consumer_out
        .find(|l| l.as_ref().is_ok_and(|l| l == "READY"))
        .ok_or("the consumer did not connect back")?
        .map_err(|e| e.to_string())?;
    writeln!(producer.0.stdin.as_mut().ok_or("no stdin")?, "GO").map_err(|e| e.to_string())?;
    let mut rows = Vec::new();
    for l in producer_out {
        let l = l.map_err(|e| e.to_string())?;
        let Some(fields) = l.strip_prefix("ROW ") else {
            continue;
        };
        let f: Vec<&str> = fields.split(' ').collect();
        let [case, op_bytes, ops, bytes, seconds, post] = f[..] else {
            return Err(format!("bad row {l}"));
        };
        let parse = |s: &str| s.parse::<f64>().map_err(|e| e.to_string());
        let op_bytes = parse(op_bytes)? as u64;
        let plan = if case == "sweep" {
            sweep_plan(op_bytes)
        } else {
            request_plan(PLAN_LAYERS, PLAN_CHUNK, PLAN_RUN)
        };
        let regions = if case == "sweep" {
            1
        } else {
            PLAN_LAYERS as usize
        };
        let len = if case == "sweep" {
            SWEEP_BYTES
        } else {
            2 * PLAN_BLOCKS * PLAN_CHUNK
        };
        let mut copier = Memcpy::new(regions, len as usize);
        let memcpy = (0..3)
            .map(|_| copier.seconds(&plan))
            .fold(f64::INFINITY, f64::min);
        rows.push(Row {
            backend: format!("{backend} across hosts"),
            case: case.into(),
            op_bytes,
            ops: parse(ops)? as usize,
            bytes: parse(bytes)? as u64,
            seconds: parse(seconds)?,
            post_seconds: parse(post)?,
            memcpy_seconds: memcpy,
        });
    }
    drop(consumer_in);
    if rows.is_empty() {
        return Err(format!("{backend}: the producer reported nothing"));
    }
    Ok(rows)
}
