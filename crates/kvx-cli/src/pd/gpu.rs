//! The synthetic engine on a GPU (`--device cuda[:N]`): the KV cache in device memory, and per
//! layer the matrix products of a dense transformer layer at the model's shape (cuBLAS, bf16),
//! so that transfers and compute share the GPU as they do in serving.
//!
//! Per layer and step of `t` new tokens attending to `c` tokens of context, on one rank with
//! hidden size `h`, `q` query and `g` KV heads of `d`, and an MLP of `i` (its share):
//! QKV projection `t×h · h×(q+2g)d`; attention per KV head (its `q/g` query heads stacked):
//! `(t·q/g)×d · d×c` then `(t·q/g)×c · c×d`; output projection `t×qd · qd×h`; MLP
//! `t×h · h×2i` and `t×i · i×h`. The attention covers the whole context (no causal mask, so a
//! prompt's chunk costs what FlashAttention's rectangle would, up to the diagonal block), and
//! the element-wise work (norms, rotary embedding, softmax, activation) is left out: together a
//! few per cent of a layer's time on a GPU. One layer's weights serve every layer: each is
//! larger than the GPU's L2 cache, so every layer still streams its weights from memory.
//!
//! A decode step runs the same products for the batch (`t` = requests), its attention over each
//! request's own context buffer (memory traffic as a paged cache's), at the batch's mean
//! context length.

use std::str::FromStr;
use std::sync::Arc;

use anyhow::{bail, Context as _};
use kvx_rdma::cuda::gemm::{Blas, Operand};
use kvx_rdma::cuda::{DeviceBuffer, Event, Gpu, Stream};
use serde_json::json;

/// Where the synthetic engine keeps its KV cache and computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Device {
    /// Host memory; compute is simulated by sleeping.
    Host,
    /// CUDA device N: the cache in its memory, compute as cuBLAS products.
    Cuda(u32),
}

impl Device {
    /// The CUDA device, if any.
    pub(crate) fn cuda(self) -> Option<u32> {
        match self {
            Self::Host => None,
            Self::Cuda(n) => Some(n),
        }
    }
}

impl FromStr for Device {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s {
            "host" | "cpu" => Ok(Self::Host),
            "cuda" => Ok(Self::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(n)) => Ok(Self::Cuda(n)),
                _ => bail!("unknown device `{s}` (host, cuda, cuda:N)"),
            },
        }
    }
}

/// One rank's compute shape (the KV shape is the layout's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub(crate) struct ComputeShape {
    pub(crate) layers: u32,
    pub(crate) hidden: u64,
    pub(crate) q_heads: u64,
    pub(crate) kv_heads: u64,
    pub(crate) head_dim: u64,
    pub(crate) mlp: u64,
}

impl ComputeShape {
    /// Query heads per KV head.
    fn group(&self) -> u64 {
        (self.q_heads / self.kv_heads.max(1)).max(1)
    }

    /// Floating-point operations of one layer for `tokens` new tokens over `context` tokens.
    pub(crate) fn layer_flops(&self, tokens: u64, context: u64) -> f64 {
        let (t, c, h, d, i) = (
            tokens as f64,
            context as f64,
            self.hidden as f64,
            self.head_dim as f64,
            self.mlp as f64,
        );
        let (q, g) = (self.q_heads as f64, self.kv_heads as f64);
        2.0 * t * h * (q + 2.0 * g) * d // QKV
            + 2.0 * 2.0 * (t * q) * c * d // scores and values, every query head
            + 2.0 * t * q * d * h // output projection
            + 2.0 * t * h * 2.0 * i // gate and up
            + 2.0 * t * i * h // down
    }

    /// Floating-point operations of a prefill of `tokens` in chunks of `chunk`.
    pub(crate) fn prefill_flops(&self, tokens: u64, chunk: u64) -> f64 {
        let mut done = 0;
        let mut flops = 0.0;
        while done < tokens {
            let next = (done + chunk).min(tokens);
            flops += self.layer_flops(next - done, next) * f64::from(self.layers);
            done = next;
        }
        flops
    }
}

/// The engine's device memory: one layer's weights and the activations of the largest step.
struct Buffers {
    w_qkv: DeviceBuffer,
    w_o: DeviceBuffer,
    w_up: DeviceBuffer,
    w_down: DeviceBuffer,
    x: DeviceBuffer,
    qkv: DeviceBuffer,
    attn: DeviceBuffer,
    scores: DeviceBuffer,
    keys: DeviceBuffer,
    values: DeviceBuffer,
    mlp: DeviceBuffer,
}

/// The synthetic engine's compute on one GPU.
pub(crate) struct GpuEngine {
    gpu: Arc<Gpu>,
    stream: Stream,
    blas: Blas,
    shape: ComputeShape,
    max_rows: u64,
    max_context: u64,
    max_batch: u64,
    buffers: Buffers,
}

const BF16: u64 = 2;

impl GpuEngine {
    /// An engine for steps of at most `max_rows` tokens (a prefill chunk) over at most
    /// `max_context` tokens, and decode batches of at most `max_batch` requests.
    pub(crate) fn new(
        gpu: &Arc<Gpu>,
        shape: ComputeShape,
        max_rows: u64,
        max_context: u64,
        max_batch: u64,
    ) -> anyhow::Result<Self> {
        let s = shape;
        let rows = max_rows.max(max_batch);
        let qkv_cols = (s.q_heads + 2 * s.kv_heads) * s.head_dim;
        let kv_rows = max_context * s.kv_heads * max_batch.max(1);
        let sizes = [
            ("QKV weights", s.hidden * qkv_cols),
            ("output weights", s.q_heads * s.head_dim * s.hidden),
            ("MLP up weights", s.hidden * 2 * s.mlp),
            ("MLP down weights", s.mlp * s.hidden),
            ("hidden states", rows * s.hidden),
            ("QKV", rows * qkv_cols),
            ("attention output", rows * s.q_heads * s.head_dim),
            (
                "attention scores",
                (max_rows * s.q_heads).max(max_batch * s.q_heads) * max_context,
            ),
            ("keys", kv_rows * s.head_dim),
            ("values", kv_rows * s.head_dim),
            ("MLP activations", rows * 2 * s.mlp),
        ];
        let total: u64 = sizes.iter().map(|(_, n)| n * BF16).sum();
        let (free, _) = gpu.memory_info()?;
        if total > free {
            bail!(
                "the synthetic engine needs {:.1} GiB of GPU memory for steps of {max_rows} tokens \
                 over {max_context}; {:.1} GiB are free",
                total as f64 / f64::from(1 << 30),
                free as f64 / f64::from(1 << 30)
            );
        }
        let alloc = |(what, n): (&str, u64)| {
            DeviceBuffer::new(gpu, (n * BF16).max(2))
                .with_context(|| format!("allocating the engine's {what}"))
        };
        let mut it = sizes.into_iter().map(alloc);
        let mut next = || it.next().expect("eleven sizes");
        let buffers = Buffers {
            w_qkv: next()?,
            w_o: next()?,
            w_up: next()?,
            w_down: next()?,
            x: next()?,
            qkv: next()?,
            attn: next()?,
            scores: next()?,
            keys: next()?,
            values: next()?,
            mlp: next()?,
        };
        // Weights of small random-looking values (products over zeros run faster than real ones).
        for w in [&buffers.w_qkv, &buffers.w_o, &buffers.w_up, &buffers.w_down] {
            // bf16 values between 2^-8 and 2^-7 with varying mantissas: sums stay finite.
            w.fill_with(|i| {
                if i % 2 == 1 {
                    0x3c
                } else {
                    (i * 37 % 251) as u8
                }
            })?;
        }
        let stream = Stream::new(gpu)?;
        let blas = Blas::new(&stream)?;
        Ok(Self {
            gpu: Arc::clone(gpu),
            stream,
            blas,
            shape,
            max_rows,
            max_context,
            max_batch,
            buffers,
        })
    }

    pub(crate) fn stream(&self) -> &Stream {
        &self.stream
    }

    pub(crate) fn shape(&self) -> ComputeShape {
        self.shape
    }

    /// Enqueues one layer for `tokens` new tokens of `batch` requests (a prefill chunk: batch 1;
    /// a decode step: one token each) attending to `context` tokens each.
    pub(crate) fn layer(&self, tokens: u64, batch: u64, context: u64) -> anyhow::Result<()> {
        let s = self.shape;
        let b = &self.buffers;
        let rows = tokens * batch;
        if tokens == 0 || batch == 0 {
            return Ok(());
        }
        if rows > self.max_rows.max(self.max_batch)
            || context > self.max_context
            || batch > self.max_batch.max(1)
        {
            bail!(
                "a step of {batch}×{tokens} tokens over {context}: the engine was sized for \
                 {} rows, batches of {} and {} tokens of context",
                self.max_rows,
                self.max_batch,
                self.max_context
            );
        }
        let context = context.max(1);
        let qd = s.q_heads * s.head_dim;
        let qkv_cols = qd + 2 * s.kv_heads * s.head_dim;
        let whole = Operand::whole;
        self.blas.matmul(
            (rows, qkv_cols, s.hidden),
            1,
            whole(&b.x),
            whole(&b.w_qkv),
            whole(&b.qkv),
        )?;
        // Attention per (request, KV head): its query heads' rows against its own context.
        let group_rows = tokens * s.group();
        let heads = batch * s.kv_heads;
        self.blas.matmul(
            (group_rows, context, s.head_dim),
            heads,
            Operand::batched(&b.qkv, group_rows * s.head_dim),
            Operand::batched(&b.keys, context * s.head_dim),
            Operand::batched(&b.scores, group_rows * context),
        )?;
        self.blas.matmul(
            (group_rows, s.head_dim, context),
            heads,
            Operand::batched(&b.scores, group_rows * context),
            Operand::batched(&b.values, context * s.head_dim),
            Operand::batched(&b.attn, group_rows * s.head_dim),
        )?;
        self.blas.matmul(
            (rows, s.hidden, qd),
            1,
            whole(&b.attn),
            whole(&b.w_o),
            whole(&b.x),
        )?;
        self.blas.matmul(
            (rows, 2 * s.mlp, s.hidden),
            1,
            whole(&b.x),
            whole(&b.w_up),
            whole(&b.mlp),
        )?;
        self.blas.matmul(
            (rows, s.hidden, s.mlp),
            1,
            whole(&b.mlp),
            whole(&b.w_down),
            whole(&b.x),
        )?;
        Ok(())
    }

    /// Runs one decode step for requests with `contexts` tokens each and waits for it.
    pub(crate) fn decode_step(&self, contexts: &[u64]) -> anyhow::Result<()> {
        for group in contexts.chunks(self.max_batch.max(1) as usize) {
            let mean = group.iter().sum::<u64>() / group.len() as u64;
            let context = mean.min(self.max_context);
            for _ in 0..self.shape.layers {
                self.layer(1, group.len() as u64, context)?;
            }
        }
        self.stream.synchronize()?;
        Ok(())
    }

    /// Measures the engine on this GPU: the bf16 product rate of a large square product, a
    /// prefill of `tokens` in chunks of `chunk` against its FLOP count at that rate, and decode
    /// steps. Returns JSON for the report.
    pub(crate) fn calibrate(&self, tokens: u64, chunk: u64) -> anyhow::Result<serde_json::Value> {
        let time = |f: &dyn Fn() -> anyhow::Result<()>, repeats: u32| -> anyhow::Result<f64> {
            f()?; // warm
            let (start, end) = (Event::new(&self.gpu)?, Event::new(&self.gpu)?);
            start.record(&self.stream)?;
            for _ in 0..repeats {
                f()?;
            }
            end.record(&self.stream)?;
            Ok(f64::from(end.elapsed_ms_since(&start)?) / f64::from(repeats))
        };
        // The largest square product the MLP buffers hold, at most 8192.
        let b = &self.buffers;
        let side = [8192u64, 4096, 2048, 1024]
            .into_iter()
            .find(|n| {
                [&b.w_up, &b.mlp, &b.scores]
                    .iter()
                    .all(|buf| buf.len() >= n * n * BF16)
            })
            .unwrap_or(512);
        let square = || -> anyhow::Result<()> {
            let n = side;
            if b.w_up.len() < n * n * BF16 {
                bail!("no room for a {n}² product");
            }
            Ok(self.blas.matmul(
                (n, n, n),
                1,
                Operand::whole(&b.w_up),
                Operand::whole(&b.mlp),
                Operand::whole(&b.scores),
            )?)
        };
        let square_ms = time(&square, 10)?;
        let rate = 2.0 * (side as f64).powi(3) / (square_ms / 1e3);
        let chunk = chunk.min(self.max_rows).max(1);
        let tokens = tokens.min(self.max_context);
        let prefill = || -> anyhow::Result<()> {
            let mut done = 0;
            while done < tokens {
                let next = (done + chunk).min(tokens);
                for _ in 0..self.shape.layers {
                    self.layer(next - done, 1, next)?;
                }
                done = next;
            }
            Ok(())
        };
        let prefill_ms = time(&prefill, 3)?;
        let flops = self.shape.prefill_flops(tokens, chunk);
        let expected_ms = flops / rate * 1e3;
        let mut decode = Vec::new();
        for batch in [1u64, 8, 32] {
            if batch > self.max_batch {
                continue;
            }
            let contexts = vec![tokens; batch as usize];
            self.decode_step(&contexts)?; // warm
            let n = 5;
            let started = std::time::Instant::now();
            for _ in 0..n {
                self.decode_step(&contexts)?;
            }
            decode.push(json!({
                "batch": batch,
                "context_tokens": tokens,
                "step_ms": started.elapsed().as_secs_f64() * 1e3 / f64::from(n),
            }));
        }
        Ok(json!({
            "device": self.gpu.ordinal(),
            "pci": self.gpu.pci_address(),
            "shape": self.shape,
            "gemm_bf16_square": side,
            "gemm_bf16_tflops": rate / 1e12,
            "prefill_tokens": tokens,
            "prefill_chunk_tokens": chunk,
            "prefill_ms": prefill_ms,
            "prefill_ms_per_1k_tokens": prefill_ms * 1024.0 / tokens as f64,
            "prefill_tflop": flops / 1e12,
            "prefill_expected_ms_at_gemm_rate": expected_ms,
            "prefill_measured_over_expected": prefill_ms / expected_ms,
            "decode_steps": decode,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_refuse_unknown_names() {
        assert_eq!("host".parse::<Device>().unwrap(), Device::Host);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda3"] {
            let e = bad.parse::<Device>().unwrap_err();
            assert!(e.to_string().contains("unknown device"), "{bad}: {e}");
        }
    }

    #[test]
    fn flops_follow_the_shape() {
        // One rank of Qwen3-32B at TP8.
        let s = ComputeShape {
            layers: 64,
            hidden: 5120,
            q_heads: 8,
            kv_heads: 1,
            head_dim: 128,
            mlp: 3200,
        };
        // 1,024 tokens at context 1,024: QKV 13.4, attention 4.3, output 10.7, MLP 100.7 GFLOP.
        let layer = s.layer_flops(1024, 1024);
        assert!((layer / 1e9 - 129.2).abs() < 0.5, "{layer}");
        // Chunks add their growing attention: two chunks of 1,024 cost more than twice one.
        assert!(s.prefill_flops(2048, 1024) > 2.0 * s.prefill_flops(1024, 1024));
        assert_eq!(
            s.prefill_flops(2048, 2048),
            s.layer_flops(2048, 2048) * 64.0
        );
    }
}
