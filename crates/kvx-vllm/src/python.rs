//! The Python extension module `kvx_vllm._native` (feature `python`): the [`Producer`] and
//! [`Consumer`] with plain Python types — strings for request and transfer ids, lists of ints
//! for block ids, `(address, length)` pairs of ints for the cache's memory — so that the vLLM
//! glue in `python/kvx_vllm/` stays thin: it only translates vLLM's calls into these.
//!
//! Ids: vLLM's request id strings are hashed into [`RequestId`]s and mapped back when a result is
//! reported; the router's transfer id strings are hashed into [`TransferId`]s, so both engines
//! derive the same id from the same string.
//!
//! Token units: a cache described at block granularity (one "token" of the [`LayoutSpec`] is a
//! whole engine block, see `docs/vllm.md`) is given `token_unit` = the engine's block size; token
//! counts from the engine are converted here (a partial last block is sent whole).

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use kvx_core::{
    Arrangement, Attempt, BlockId, Dtype, EngineId, GroupBlocks, LayoutSpec, MemoryKind,
    MemoryOrder, RequestBlocks, RequestId, TransferId,
};
use kvx_rdma::region::LocalRegion;
use kvx_rdma::topology::RailOverrides;
use kvx_rendezvous::AttemptKey;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::settings;
use crate::{
    ConnectorConfig, Consumer, KvCache, OpenOptions, Producer, PullRequest, PushRequest, RecvEvent,
    SendOutcome, TransportSpec,
};

fn value_err(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

fn closed_err() -> PyErr {
    PyRuntimeError::new_err("the kvx connector has shut down")
}

fn parse_dtype(s: &str) -> PyResult<Dtype> {
    Dtype::ALL
        .into_iter()
        .find(|d| d.name() == s)
        .ok_or_else(|| {
            value_err(format!(
                "unknown dtype `{s}` (f32, f16, bf16, fp8_e4m3, fp8_e5m2, int8)"
            ))
        })
}

fn parse_order(s: &str) -> PyResult<MemoryOrder> {
    s.parse()
        .map_err(|e: kvx_core::UnknownName| value_err(e.to_string()))
}

fn parse_arrangement(s: &str) -> PyResult<Arrangement> {
    s.parse()
        .map_err(|e: kvx_core::UnknownName| value_err(e.to_string()))
}

fn parse_addr(s: &str) -> PyResult<SocketAddr> {
    s.to_socket_addrs()
        .map_err(|e| value_err(format!("bad address `{s}`: {e}")))?
        .next()
        .ok_or_else(|| value_err(format!("address `{s}` resolves to nothing")))
}

fn blocks(ids: Vec<i64>) -> PyResult<Vec<BlockId>> {
    ids.into_iter()
        .map(|b| {
            u32::try_from(b)
                .map(BlockId)
                .map_err(|_| value_err(format!("block id {b} out of range")))
        })
        .collect()
}

/// A hybrid model's further KV cache groups, `(first_token, block_ids)` each, `first_token` in
/// engine tokens: each group keeps the units of `unit` tokens from the first that lies wholly
/// at or after it.
fn groups(groups: Option<Vec<(u64, Vec<i64>)>>, unit: u64) -> PyResult<Vec<GroupBlocks>> {
    groups
        .unwrap_or_default()
        .into_iter()
        .map(|(first, ids)| {
            let first = first.div_ceil(unit);
            Ok(GroupBlocks {
                first_token: u32::try_from(first)
                    .map_err(|_| value_err(format!("first token {first} out of range")))?,
                blocks: blocks(ids)?,
            })
        })
        .collect()
}

fn key(transfer_id: &str, attempt: u32) -> AttemptKey {
    AttemptKey::new(TransferId::from_str_hash(transfer_id), Attempt(attempt))
}

fn secs(name: &str, v: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(v).map_err(|e| value_err(format!("{name}: {e}")))
}

/// Runs `f`, which may wait up to `wait`, without the GIL unless `wait` is zero (a plain poll,
/// cheaper with the GIL kept).
fn detached_if_waiting<T: Send>(py: Python<'_>, wait: Duration, f: impl FnOnce() -> T + Send) -> T {
    if wait.is_zero() {
        f()
    } else {
        py.detach(f)
    }
}

/// Everything both classes take at start: identity, timings, the cache and the transport.
struct StartArgs {
    config: ConnectorConfig,
    cache: KvCache,
    transport: TransportSpec,
    options: OpenOptions,
    token_unit: u64,
}

/// The transport a side opens: its name, the CUDA device of the cache (`None`: host memory)
/// and where the NIXL runtime is (what the Python glue found: `KVX_NIXL_LIB_DIR`, else the
/// installed wheel's).
struct TransportArgs<'a> {
    name: &'a str,
    cuda_device: Option<u32>,
    nixl_library: Option<std::path::PathBuf>,
    /// The `rails` setting (`GPU=NIC,NIC;…`, or empty).
    rails: &'a str,
}

#[allow(clippy::too_many_arguments)]
fn start_args(
    engine_id: &str,
    layout: &Bound<'_, PyDict>,
    regions: Vec<(usize, u64)>,
    transport: TransportArgs<'_>,
    listen: &str,
    token_unit: u64,
    timings: &Bound<'_, PyDict>,
    max_entries: Option<usize>,
    auth: (Option<std::path::PathBuf>, bool),
) -> PyResult<StartArgs> {
    fn get<'py, T: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, k: &str) -> PyResult<T> {
        let item = d
            .get_item(k)?
            .ok_or_else(|| value_err(format!("layout lacks `{k}`")))?;
        item.extract::<T>().map_err(|e| {
            let e: PyErr = e.into();
            value_err(format!("layout `{k}`: {e}"))
        })
    }
    let spec = LayoutSpec {
        num_layers: get(layout, "num_layers")?,
        total_kv_heads: get(layout, "total_kv_heads")?,
        head_dim: get(layout, "head_dim")?,
        dtype: parse_dtype(&get::<String>(layout, "dtype")?)?,
        mla: get(layout, "mla")?,
        block_tokens: get(layout, "block_tokens")?,
        num_blocks: get(layout, "num_blocks")?,
        tp_size: get(layout, "tp_size")?,
        tp_rank: get(layout, "tp_rank")?,
        order: parse_order(&get::<String>(layout, "order")?)?,
        arrangement: parse_arrangement(&get::<String>(layout, "arrangement")?)?,
    };
    if token_unit == 0 {
        return Err(value_err("token_unit must be at least 1"));
    }
    let mut config = ConnectorConfig::new(EngineId::from_name(engine_id));
    config.listen = parse_addr(listen)?;
    // Each named by its setting's key or its ConnectorConfig field, checked by the one table.
    for (k, v) in timings.iter() {
        let name: String = k.extract()?;
        let value = parse_setting(&name, &v)?;
        settings::apply(&mut config, &name, &value).map_err(value_err)?;
    }
    if let Some(m) = max_entries {
        let value = settings::Value::Count(m as u64);
        settings::apply(&mut config, "max_entries", &value).map_err(value_err)?;
    }
    let (auth_key_file, allow_unauthenticated) = auth;
    if let Some(path) = auth_key_file {
        let key = crate::AuthKey::load(&path).map_err(value_err)?;
        config.auth_key = Some(std::sync::Arc::new(key));
    }
    config.allow_unauthenticated = allow_unauthenticated;
    let TransportArgs {
        name,
        cuda_device,
        nixl_library,
        rails,
    } = transport;
    // The `rails` setting, else KVX_RAILS (the plugin maps the environment).
    let rails = crate::transport::rail_overrides(rails, std::env::var_os(RailOverrides::ENV_VAR))
        .map_err(value_err)?;
    let transport: TransportSpec = name.parse().map_err(value_err)?;
    // The memory kind is the cache's (the Python glue resolved the transport for it, so
    // `cuda-ipc:N` names the cache's device N).
    let kind = match (&transport, cuda_device) {
        (TransportSpec::CudaIpc { device }, _) => MemoryKind::Cuda { device: *device },
        (_, Some(device)) => MemoryKind::Cuda { device },
        (_, None) => MemoryKind::Host,
    };
    // What the operator asks for in the environment (the plugin, not the library, reads it);
    // a NIXL runtime the glue names wins.
    let mut options = OpenOptions::from_environment(|k| std::env::var_os(k));
    if nixl_library.is_some() {
        options.nixl_library = nixl_library;
    }
    let options = options
        .for_cuda_device(match kind {
            MemoryKind::Cuda { device } => Some(device),
            _ => None,
        })
        .with_rail_overrides(rails);
    // Decode's `peers` say where its prefills are before it meets one.
    let options = match config.peers.first_host() {
        Some(peer) => options.with_peer(peer),
        None => options,
    };
    let regions = regions
        .into_iter()
        .enumerate()
        .map(|(i, (addr, len))| {
            if addr == 0 {
                return Err(value_err(format!("region {i} has a null address")));
            }
            let index = u32::try_from(i).map_err(value_err)?;
            // SAFETY: the caller (the vLLM glue) passes the data pointer and byte length of a
            // KV-cache tensor that the engine allocated once at start and keeps alive, unmoved,
            // for the life of the engine process; the glue keeps a reference to every tensor for
            // as long as this object lives, and only the engine's kernels and the transport touch
            // that memory (no Rust reference into it exists).
            Ok(unsafe { LocalRegion::from_raw(index, kind, addr as *mut u8, len) })
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(StartArgs {
        config,
        cache: KvCache {
            layout: spec,
            regions,
        },
        transport,
        options,
        token_unit,
    })
}

/// A side's counters and gauges, its failures by cause (`failed.CAUSE`) and its rails
/// (`rail.NAME`: 1).
fn stats_dict<'py>(py: Python<'py>, reader: &crate::StatsReader) -> PyResult<Bound<'py, PyDict>> {
    let s = reader.snapshot();
    let d = PyDict::new(py);
    d.set_item("held", s.held)?;
    d.set_item("transfers_started", s.transfers_started)?;
    d.set_item("transfers_ok", s.transfers_ok)?;
    d.set_item("transfers_failed", s.transfers_failed)?;
    d.set_item("bytes_written", s.bytes_written)?;
    d.set_item("bytes_streamed", s.bytes_streamed)?;
    d.set_item("finishing_hints", s.finishing_hints)?;
    d.set_item("nudges", s.nudges)?;
    d.set_item("remembered_registrations", s.remembered_registrations)?;
    d.set_item("board_ready", s.board_ready)?;
    d.set_item("local_connections", s.local_connections)?;
    d.set_item("driver_turns", s.driver_turns)?;
    d.set_item("released_unconfirmed", s.released_unconfirmed)?;
    d.set_item("handshakes_evicted", s.handshakes_evicted)?;
    d.set_item("handshakes_failed", s.handshakes_failed)?;
    d.set_item("idle_closed", s.idle_closed)?;
    d.set_item("unauthorized", s.unauthorized)?;
    d.set_item("ops_posted", s.ops_posted)?;
    d.set_item("in_flight", s.in_flight)?;
    for (cause, n) in reader.failures_by_cause() {
        d.set_item(format!("failed.{cause}"), n)?;
    }
    for rail in reader.rails() {
        d.set_item(format!("rail.{rail}"), 1)?;
    }
    Ok(d)
}

/// Request id strings by hash, for the requests handed to a side and not yet reported back.
#[derive(Default)]
struct Names(Mutex<HashMap<RequestId, String>>);

impl Names {
    fn insert(&self, name: &str) -> RequestId {
        let id = RequestId::from_str_hash(name);
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, name.to_owned());
        id
    }

    fn take(&self, id: RequestId) -> String {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id)
            .unwrap_or_else(|| id.to_string())
    }

    fn forget(&self, id: RequestId) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
    }
}

/// The prefill side of one engine rank.
#[pyclass(frozen, name = "Producer", module = "kvx_vllm._native")]
struct PyProducer {
    inner: Mutex<Option<Producer>>,
    names: Names,
    token_unit: u64,
    addr: SocketAddr,
}

impl PyProducer {
    fn with<T>(&self, f: impl FnOnce(&Producer) -> T) -> PyResult<T> {
        let guard = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        guard.as_ref().map(f).ok_or_else(closed_err)
    }

    fn tokens(&self, n: u64) -> u64 {
        n.div_ceil(self.token_unit)
    }

    /// A finished (or sealed) request's key, blocks and token units, checked.
    fn request_args(
        &self,
        transfer_id: &str,
        block_ids: Vec<i64>,
        further: Option<Vec<(u64, Vec<i64>)>>,
        num_tokens: u64,
        attempt: u32,
    ) -> PyResult<(AttemptKey, RequestBlocks, u64)> {
        let blocks = RequestBlocks {
            blocks: blocks(block_ids)?,
            groups: groups(further, self.token_unit)?,
        };
        Ok((key(transfer_id, attempt), blocks, self.tokens(num_tokens)))
    }

    /// Hands a finished request's blocks over (checked by [`Self::request_args`]).
    fn finished(
        &self,
        request_id: &str,
        (key, blocks, tokens): (AttemptKey, RequestBlocks, u64),
        pull: bool,
    ) -> PyResult<()> {
        let request = self.names.insert(request_id);
        let sent = self.with(|p| {
            if pull {
                p.request_finished_pull(key, request, blocks, tokens)
            } else {
                p.request_finished(key, request, blocks, tokens)
            }
        })?;
        sent.map_err(|_| {
            self.names.forget(request);
            closed_err()
        })
    }
}

#[pymethods]
impl PyProducer {
    /// Registers the cache's memory with the transport and starts listening on `listen` (this
    /// rank's kvx control address; port 0 picks one).
    #[new]
    #[pyo3(signature = (engine_id, layout, regions, *, transport = "libfabric:shm", listen = "127.0.0.1:0", token_unit = 1, timings = None, max_entries = None, cuda_device = None, nixl_library = None, rails = "", auth_key_file = None, allow_unauthenticated = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        engine_id: &str,
        layout: &Bound<'_, PyDict>,
        regions: Vec<(usize, u64)>,
        transport: &str,
        listen: &str,
        token_unit: u64,
        timings: Option<&Bound<'_, PyDict>>,
        max_entries: Option<usize>,
        cuda_device: Option<u32>,
        nixl_library: Option<std::path::PathBuf>,
        rails: &str,
        auth_key_file: Option<std::path::PathBuf>,
        allow_unauthenticated: bool,
    ) -> PyResult<Self> {
        let empty = PyDict::new(py);
        let args = start_args(
            engine_id,
            layout,
            regions,
            TransportArgs {
                name: transport,
                cuda_device,
                nixl_library,
                rails,
            },
            listen,
            token_unit,
            timings.unwrap_or(&empty),
            max_entries,
            (auth_key_file, allow_unauthenticated),
        )?;
        let StartArgs {
            config,
            cache,
            transport,
            options,
            token_unit,
        } = args;
        let producer = py.detach(move || -> Result<Producer, PluginStartError> {
            let t = transport.open_with(&options.reached_at(config.listen.ip()))?;
            Ok(Producer::start(config, cache, t)?)
        });
        let producer = producer.map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        let addr = producer.control_addr();
        Ok(Self {
            inner: Mutex::new(Some(producer)),
            names: Names::default(),
            token_unit,
            addr,
        })
    }

    /// This rank's control address, `HOST:PORT`.
    #[getter]
    fn control_addr(&self) -> String {
        self.addr.to_string()
    }

    /// The request of `transfer_id` belongs to the W3C trace `traceparent` (`kvx_trace`): this
    /// rank keeps a `kvx.send` span for it. A malformed one is ignored (nothing is traced).
    fn trace(&self, transfer_id: &str, traceparent: &str) -> PyResult<()> {
        let Ok(trace) = traceparent.parse() else {
            return Ok(());
        };
        let t = TransferId::from_str_hash(transfer_id);
        self.with(|p| p.trace(t, trace))?.map_err(|_| closed_err())
    }

    /// Prefill finished the request (push): its blocks are held until decode's registration
    /// arrives, then written; they come back through `take_finished`.
    #[pyo3(signature = (transfer_id, request_id, block_ids, num_tokens, attempt = 0, groups = None))]
    fn request_finished(
        &self,
        transfer_id: &str,
        request_id: &str,
        block_ids: Vec<i64>,
        num_tokens: u64,
        attempt: u32,
        groups: Option<Vec<(u64, Vec<i64>)>>,
    ) -> PyResult<()> {
        let args = self.request_args(transfer_id, block_ids, groups, num_tokens, attempt)?;
        self.finished(request_id, args, false)
    }

    /// The request's KV (push) is complete and final in `block_ids`, and the engine will
    /// finish the request with these tokens: it is written, and decode told, as soon as decode
    /// has registered. The blocks stay the engine's until `request_finished` for the same
    /// request, which must follow (or `abort`); `take_finished` reports them only after it.
    #[pyo3(signature = (transfer_id, request_id, block_ids, num_tokens, attempt = 0, groups = None))]
    fn request_sealed(
        &self,
        transfer_id: &str,
        request_id: &str,
        block_ids: Vec<i64>,
        num_tokens: u64,
        attempt: u32,
        groups: Option<Vec<(u64, Vec<i64>)>>,
    ) -> PyResult<()> {
        let (key, blocks, tokens) =
            self.request_args(transfer_id, block_ids, groups, num_tokens, attempt)?;
        // Named when the request finishes: an aborted one never is, and leaves no name here.
        let request = RequestId::from_str_hash(request_id);
        self.with(|p| p.request_sealed(key, request, blocks, tokens))?
            .map_err(|_| closed_err())
    }

    /// Prefill of the request (push) is still running and its first `computed_tokens` tokens
    /// are final in `block_ids` (its blocks so far): they are written to decode now if it has
    /// registered. With `layers`, they are final in the first `layers` layers only (a step
    /// computing layer by layer). Optional; `request_finished` writes whatever is left.
    #[pyo3(signature = (transfer_id, block_ids, computed_tokens, attempt = 0, layers = None))]
    fn request_progress(
        &self,
        transfer_id: &str,
        block_ids: Vec<i64>,
        computed_tokens: u64,
        attempt: u32,
        layers: Option<u32>,
    ) -> PyResult<()> {
        let blocks = blocks(block_ids)?;
        let key = key(transfer_id, attempt);
        // Whole units only: a unit still being computed is not final.
        let units = computed_tokens / self.token_unit;
        self.with(|p| match layers {
            Some(layers) => p.request_layer_progress(key, blocks, units, layers),
            None => p.request_progress(key, blocks, units),
        })?
        .map_err(|_| closed_err())
    }

    /// Prefill finished the request (pull): its blocks are held until decode has read them.
    #[pyo3(signature = (transfer_id, request_id, block_ids, num_tokens, attempt = 0, groups = None))]
    fn request_finished_pull(
        &self,
        transfer_id: &str,
        request_id: &str,
        block_ids: Vec<i64>,
        num_tokens: u64,
        attempt: u32,
        groups: Option<Vec<(u64, Vec<i64>)>>,
    ) -> PyResult<()> {
        let args = self.request_args(transfer_id, block_ids, groups, num_tokens, attempt)?;
        self.finished(request_id, args, true)
    }

    /// Aborts every attempt of a transfer (or one, given `attempt`).
    #[pyo3(signature = (transfer_id, attempt = None))]
    fn abort(&self, transfer_id: &str, attempt: Option<u32>) -> PyResult<()> {
        let t = TransferId::from_str_hash(transfer_id);
        self.with(|p| p.abort(t, attempt.map(Attempt)))?
            .map_err(|_| closed_err())
    }

    /// The engine preempted the request at this attempt.
    #[pyo3(signature = (transfer_id, attempt = 0))]
    fn preempted(&self, transfer_id: &str, attempt: u32) -> PyResult<()> {
        let k = key(transfer_id, attempt);
        self.with(|p| p.preempted(k))?.map_err(|_| closed_err())
    }

    /// Requests whose blocks the engine may free now: `(request_id, sent, reason)`; `reason` is
    /// empty when sent. With `wait_s`, when none has ended yet, waits up to that long (without
    /// the GIL) for the first.
    #[pyo3(signature = (wait_s = 0.0))]
    fn take_finished(&self, py: Python<'_>, wait_s: f64) -> PyResult<Vec<(String, bool, String)>> {
        let wait = secs("wait_s", wait_s)?;
        let done = detached_if_waiting(py, wait, || self.with(|p| p.wait_finished(wait)))?;
        Ok(done
            .into_iter()
            .map(|f| {
                let (sent, reason) = match f.outcome {
                    SendOutcome::Sent => (true, String::new()),
                    SendOutcome::NotSent(r) => (false, r.to_string()),
                };
                (self.names.take(f.request), sent, reason)
            })
            .collect())
    }

    /// Counters: held, transfers_started, transfers_ok, transfers_failed, bytes_written,
    /// bytes_streamed, finishing_hints, nudges, handshakes_evicted (connections dropped before
    /// their hello for newer ones), handshakes_failed (hellos late, malformed or of another
    /// protocol version), idle_closed (connections silent for the idle timeout), unauthorized
    /// (capabilities refused), ops_posted, in_flight, and
    /// `failed.CAUSE` and `rail.NAME` entries.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let reader = self.with(Producer::stats_reader)?;
        stats_dict(py, &reader)
    }

    /// The push transfers that finished since the last call, as `(seconds, bytes)` pairs: the
    /// time from the post of each one's last writes to their completion, and their bytes.
    fn take_transfer_samples(&self) -> PyResult<Vec<(f64, u64)>> {
        let samples = self.with(Producer::take_transfer_samples)?;
        Ok(samples.into_iter().map(|s| (s.seconds, s.bytes)).collect())
    }

    /// Stops the threads; blocks still held are reported by a last `take_finished` (call it
    /// before this, or lose them).
    fn shutdown(&self, py: Python<'_>) {
        let producer = self
            .inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(mut p) = producer {
            py.detach(move || p.shutdown());
        }
    }
}

/// The decode side of one engine rank.
#[pyclass(frozen, name = "Consumer", module = "kvx_vllm._native")]
struct PyConsumer {
    inner: Mutex<Option<Consumer>>,
    names: Names,
    token_unit: u64,
}

impl PyConsumer {
    fn with<T>(&self, f: impl FnOnce(&Consumer) -> T) -> PyResult<T> {
        let guard = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        guard.as_ref().map(f).ok_or_else(closed_err)
    }

    #[allow(clippy::too_many_arguments)]
    fn push_request(
        &self,
        transfer_id: &str,
        request_id: &str,
        prefill: &str,
        num_tokens: u64,
        skip_tokens: u64,
        block_ids: Vec<i64>,
        further: Option<Vec<(u64, Vec<i64>)>>,
        attempt: u32,
    ) -> PyResult<PushRequest> {
        if skip_tokens > num_tokens {
            return Err(value_err(format!(
                "skip_tokens {skip_tokens} exceeds num_tokens {num_tokens}"
            )));
        }
        if !skip_tokens.is_multiple_of(self.token_unit) {
            return Err(value_err(format!(
                "skip_tokens {skip_tokens} is not a whole number of blocks of {}",
                self.token_unit
            )));
        }
        Ok(PushRequest {
            groups: groups(further, self.token_unit)?,
            key: key(transfer_id, attempt),
            request: RequestId::from_str_hash(request_id),
            prefill: parse_addr(prefill)?,
            num_tokens: num_tokens.div_ceil(self.token_unit),
            skip_tokens: skip_tokens / self.token_unit,
            blocks: blocks(block_ids)?,
            capability: None,
            trace: None,
        })
    }

    fn submit(
        &self,
        request_id: &str,
        f: impl FnOnce(&Consumer) -> Result<(), crate::Closed>,
    ) -> PyResult<()> {
        let id = self.names.insert(request_id);
        self.with(f)?.map_err(|_| {
            self.names.forget(id);
            closed_err()
        })
    }
}

/// A router's capability from its text and the prefill address it was written with.
fn parse_capability(
    capability: Option<(String, String)>,
) -> PyResult<Option<kvx_core::wire::Capability>> {
    capability
        .map(|(text, prefill)| {
            crate::capability::from_text(&text, &prefill)
                .ok_or_else(|| value_err(format!("malformed kvx_capability `{text}`")))
        })
        .transpose()
}

#[pymethods]
impl PyConsumer {
    /// Registers the cache's memory with the transport and starts the driver thread.
    #[new]
    #[pyo3(signature = (engine_id, layout, regions, *, transport = "libfabric:shm", token_unit = 1, timings = None, max_entries = None, cuda_device = None, nixl_library = None, rails = "", auth_key_file = None, allow_unauthenticated = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        engine_id: &str,
        layout: &Bound<'_, PyDict>,
        regions: Vec<(usize, u64)>,
        transport: &str,
        token_unit: u64,
        timings: Option<&Bound<'_, PyDict>>,
        max_entries: Option<usize>,
        cuda_device: Option<u32>,
        nixl_library: Option<std::path::PathBuf>,
        rails: &str,
        auth_key_file: Option<std::path::PathBuf>,
        allow_unauthenticated: bool,
    ) -> PyResult<Self> {
        let empty = PyDict::new(py);
        let StartArgs {
            config,
            cache,
            transport,
            options,
            token_unit,
        } = start_args(
            engine_id,
            layout,
            regions,
            TransportArgs {
                name: transport,
                cuda_device,
                nixl_library,
                rails,
            },
            "127.0.0.1:0",
            token_unit,
            timings.unwrap_or(&empty),
            max_entries,
            (auth_key_file, allow_unauthenticated),
        )?;
        let consumer = py.detach(move || -> Result<Consumer, PluginStartError> {
            let t = transport.open_with(&options)?;
            Ok(Consumer::start(config, cache, t)?)
        });
        Ok(Self {
            inner: Mutex::new(Some(
                consumer.map_err(|e| PyRuntimeError::new_err(e.to_string()))?,
            )),
            names: Names::default(),
            token_unit,
        })
    }

    /// Decode allocated `block_ids` (from token 0) for a remotely prefilled request (push):
    /// registers them with the prefill instance whose rank 0 listens at `prefill`.
    /// `capability`: the router's (`kvx_capability`, and `kvx_prefill` as the router wrote it);
    /// `trace`: the request's W3C `traceparent` (`kvx_trace`; a malformed one is ignored).
    #[pyo3(signature = (transfer_id, request_id, prefill, num_tokens, skip_tokens, block_ids, attempt = 0, capability = None, trace = None, groups = None))]
    #[allow(clippy::too_many_arguments)]
    fn request_allocated(
        &self,
        transfer_id: &str,
        request_id: &str,
        prefill: &str,
        num_tokens: u64,
        skip_tokens: u64,
        block_ids: Vec<i64>,
        attempt: u32,
        capability: Option<(String, String)>,
        trace: Option<&str>,
        groups: Option<Vec<(u64, Vec<i64>)>>,
    ) -> PyResult<()> {
        let mut r = self.push_request(
            transfer_id,
            request_id,
            prefill,
            num_tokens,
            skip_tokens,
            block_ids,
            groups,
            attempt,
        )?;
        r.capability = parse_capability(capability)?;
        r.trace = trace.and_then(|t| t.parse().ok());
        self.submit(request_id, |c| c.request_allocated(r))
    }

    /// Reads a prefilled request's KV (pull): `producer_block_ids` are prefill's blocks, as its
    /// response's `kv_transfer_params` relayed them.
    #[pyo3(signature = (transfer_id, request_id, prefill, num_tokens, skip_tokens, block_ids, producer_block_ids, attempt = 0, capability = None, trace = None, groups = None, producer_groups = None))]
    #[allow(clippy::too_many_arguments)]
    fn pull(
        &self,
        transfer_id: &str,
        request_id: &str,
        prefill: &str,
        num_tokens: u64,
        skip_tokens: u64,
        block_ids: Vec<i64>,
        producer_block_ids: Vec<i64>,
        attempt: u32,
        capability: Option<(String, String)>,
        trace: Option<&str>,
        groups: Option<Vec<(u64, Vec<i64>)>>,
        producer_groups: Option<Vec<(u64, Vec<i64>)>>,
    ) -> PyResult<()> {
        let mut push = self.push_request(
            transfer_id,
            request_id,
            prefill,
            num_tokens,
            skip_tokens,
            block_ids,
            groups,
            attempt,
        )?;
        push.capability = parse_capability(capability)?;
        push.trace = trace.and_then(|t| t.parse().ok());
        let r = PullRequest {
            producer_groups: self::groups(producer_groups, self.token_unit)?,
            push,
            producer_blocks: blocks(producer_block_ids)?,
        };
        self.submit(request_id, |c| c.pull(r))
    }

    /// Gives up on a transfer: the request is reported failed (reason `aborted`).
    #[pyo3(signature = (transfer_id, attempt = None))]
    fn cancel(&self, transfer_id: &str, attempt: Option<u32>) -> PyResult<()> {
        let t = TransferId::from_str_hash(transfer_id);
        self.with(|c| c.cancel(t, attempt.map(Attempt)))?
            .map_err(|_| closed_err())
    }

    /// The engine dropped a push request that will never register (aborted before decode
    /// allocated its blocks): the prefill instance whose rank 0 listens at `prefill` (an IP
    /// address and port) gives the transfer's KV back now rather than at its lease, if this
    /// consumer is connected to it.
    #[pyo3(signature = (transfer_id, prefill, capability = None))]
    fn abandon(
        &self,
        transfer_id: &str,
        prefill: &str,
        capability: Option<(String, String)>,
    ) -> PyResult<()> {
        let addr: SocketAddr = prefill
            .parse()
            .map_err(|e| value_err(format!("bad address `{prefill}`: {e}")))?;
        let t = TransferId::from_str_hash(transfer_id);
        let capability = parse_capability(capability)?;
        self.with(|c| c.abandon(addr, t, capability))?
            .map_err(|_| closed_err())
    }

    /// What happened since the last call: `(request_id, ok, reason, detail)`.
    #[pyo3(signature = (wait_s = 0.0))]
    fn take_events(
        &self,
        py: Python<'_>,
        wait_s: f64,
    ) -> PyResult<Vec<(String, bool, String, String)>> {
        let wait = secs("wait_s", wait_s)?;
        let events = detached_if_waiting(py, wait, || self.with(|c| c.wait_events(wait)))?;
        Ok(events
            .into_iter()
            .map(|e| match e {
                RecvEvent::Ready { request, .. } => {
                    (self.names.take(request), true, String::new(), String::new())
                }
                RecvEvent::Failed {
                    request,
                    reason,
                    detail,
                    ..
                } => (self.names.take(request), false, reason.to_string(), detail),
            })
            .collect())
    }

    /// Counters: held (requests waiting), transfers_started, transfers_ok, transfers_failed,
    /// bytes_written, finishing_hints, board_ready (push requests found ready in the notice
    /// board), driver_turns (wake-ups of the driver thread), local_connections (control
    /// connections made over a Unix socket), and the producer's other entries.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let reader = self.with(Consumer::stats_reader)?;
        stats_dict(py, &reader)
    }

    /// Seconds each request that became ready since the last call waited for its KV, from its
    /// registration (push) or the post of its reads (pull).
    fn take_wait_samples(&self) -> PyResult<Vec<f64>> {
        self.with(Consumer::take_wait_samples)
    }

    /// Stops the driver; waiting requests are reported failed by a last `take_events`.
    fn shutdown(&self, py: Python<'_>) {
        let consumer = self
            .inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(mut c) = consumer {
            py.detach(move || c.shutdown());
        }
    }
}

/// Sends the connector's logs (Rust `tracing`) to standard error, filtered by `filter` (the
/// `RUST_LOG` syntax, e.g. `kvx_vllm=info`), and, with `otlp_endpoint` (`http://HOST:PORT`),
/// its request spans to that OpenTelemetry collector as service `service`. Once per process;
/// later calls return False. ValueError for a malformed endpoint.
#[pyfunction]
#[pyo3(signature = (filter = "warn", otlp_endpoint = None, service = "kvx"))]
fn init_logging(filter: &str, otlp_endpoint: Option<&str>, service: &str) -> PyResult<bool> {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    crate::trace::otlp::init(filter, otlp_endpoint.filter(|e| !e.is_empty()), service)
        .map_err(value_err)
}

/// The number of a transfer id string, as both engines derive it (hex), for logs and tests.
#[pyfunction]
fn transfer_id_hash(transfer_id: &str) -> String {
    TransferId::from_str_hash(transfer_id).to_string()
}

/// Whether libfabric's `shm` moves data by cross-memory attach in this process, so that a
/// decode over `shm` gets a notice board (false without the libfabric transport).
#[pyfunction]
fn shm_uses_cma() -> bool {
    #[cfg(feature = "libfabric")]
    {
        kvx_rdma::libfabric::shm_uses_cma()
    }
    #[cfg(not(feature = "libfabric"))]
    {
        false
    }
}

/// The module `kvx_vllm._native`.
#[pymodule]
#[pyo3(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // The operator's libfabric, where named (the plugin, not the library, reads the environment).
    #[cfg(feature = "libfabric")]
    crate::transport::choose_libfabric(|k| std::env::var_os(k));
    m.add_class::<PyProducer>()?;
    m.add_class::<PyConsumer>()?;
    m.add_function(wrap_pyfunction!(init_logging, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_id_hash, m)?)?;
    m.add_function(wrap_pyfunction!(shm_uses_cma, m)?)?;
    m.add_function(wrap_pyfunction!(connector_settings, m)?)?;
    m.add_function(wrap_pyfunction!(check_settings, m)?)?;
    m.add_function(wrap_pyfunction!(rank_listen, m)?)?;
    m.add_function(wrap_pyfunction!(resolve_transport, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

/// Why the plugin could not start a side: its transport or the side itself.
#[derive(Debug, thiserror::Error)]
enum PluginStartError {
    #[error(transparent)]
    Transport(#[from] crate::TransportError),
    #[error(transparent)]
    Start(#[from] crate::StartError),
}

/// Checks the Python value `v` against the setting `name` (key or field name).
fn parse_setting(name: &str, v: &Bound<'_, PyAny>) -> PyResult<settings::Value> {
    use pyo3::types::{PyBool, PyFloat, PyInt, PyString};
    let text;
    let raw = if v.is_none() {
        settings::Raw::Unset
    } else if v.is_instance_of::<PyBool>() {
        settings::Raw::Flag(v.extract()?)
    } else if v.is_instance_of::<PyInt>() {
        settings::Raw::Int(v.extract()?)
    } else if v.is_instance_of::<PyFloat>() {
        settings::Raw::Float(v.extract()?)
    } else if v.is_instance_of::<PyString>() {
        text = v.extract::<String>()?;
        settings::Raw::Text(&text)
    } else {
        text = v.str()?.to_string();
        settings::Raw::Text(&text)
    };
    settings::parse(name, raw).map_err(value_err)
}

fn value_to_py<'py>(py: Python<'py>, value: &settings::Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        settings::Value::Number(x) => x.into_pyobject(py)?.into_any(),
        settings::Value::Count(n) => n.into_pyobject(py)?.into_any(),
        settings::Value::Flag(b) => b.into_pyobject(py)?.to_owned().into_any(),
        settings::Value::Text(t) => t.as_ref().into_pyobject(py)?.into_any(),
        _ => py.None().into_bound(py),
    })
}

/// The connector's settings, from the one table (`kvx_vllm::settings::SETTINGS`): a list of
/// dicts with `key`, `field` (the ConnectorConfig field, or None for the plugin's own), `kind`,
/// `default`, `choices` (for a choice), `max` (for milliseconds) and `doc`.
#[pyfunction]
#[pyo3(name = "settings")]
fn connector_settings(py: Python<'_>) -> PyResult<Vec<Bound<'_, PyDict>>> {
    settings::SETTINGS
        .iter()
        .map(|s| {
            let d = PyDict::new(py);
            d.set_item("key", s.key)?;
            d.set_item("field", s.field)?;
            d.set_item("kind", s.kind.name())?;
            d.set_item("default", value_to_py(py, &s.default)?)?;
            d.set_item("doc", s.doc)?;
            match s.kind {
                settings::Kind::Choice(words) => d.set_item("choices", words.to_vec())?,
                settings::Kind::Milliseconds { max } => d.set_item("max", max)?,
                _ => {}
            }
            Ok(d)
        })
        .collect()
}

/// Checks a `kv_connector_extra_config` dict against the settings and gives every setting's
/// value (the default where the dict has none), normalised (numbers from strings, flags from
/// words). Raises ValueError naming an unknown key or a value that does not fit.
#[pyfunction]
fn check_settings<'py>(
    py: Python<'py>,
    extra: &Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyDict>> {
    let mut unknown = Vec::new();
    for key in extra.keys() {
        let key: String = key.str()?.to_string();
        if !settings::SETTINGS.iter().any(|s| s.key == key) {
            unknown.push(key);
        }
    }
    if !unknown.is_empty() {
        unknown.sort();
        let known: Vec<&str> = settings::SETTINGS.iter().map(|s| s.key).collect();
        return Err(value_err(format!(
            "unknown kvx extra-config key(s) {unknown:?}; known: {known:?}"
        )));
    }
    let out = PyDict::new(py);
    for s in settings::SETTINGS {
        let value = match extra.get_item(s.key)? {
            Some(v) => parse_setting(s.key, &v)?,
            None => s.default.clone(),
        };
        out.set_item(s.key, value_to_py(py, &value)?)?;
    }
    Ok(out)
}

/// The control address of tensor-parallel rank `rank` for the `listen` setting (port + rank;
/// port 0 stays 0).
#[pyfunction]
fn rank_listen(listen: &str, rank: u32) -> PyResult<String> {
    settings::rank_listen(listen, rank).map_err(value_err)
}

/// The transport to open for a KV cache in host memory (`cuda_device` None) or on a CUDA
/// device, from the `transport` setting (see `kvx_vllm::resolve_for_cache`).
#[pyfunction]
#[pyo3(signature = (setting, cuda_device = None))]
fn resolve_transport(setting: &str, cuda_device: Option<u32>) -> PyResult<String> {
    crate::resolve_for_cache(setting, cuda_device).map_err(value_err)
}
