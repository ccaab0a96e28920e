//! CUDA-graph capture and replay of whole steps (decode), transparent to the caller's code.
//!
//! [`CudaBackend::run_graphed`] runs a closure that issues one step (e.g. one
//! `Transformer::forward`, ending in a [`Backend::to_host`](crate::Backend::to_host)):
//!
//! 1. the first call runs it eagerly, on the graph's own scratch buffers, which sizes them;
//! 2. the next call captures it into a CUDA graph: every launch is recorded with a signature
//!    (kernel, device pointers, shapes, scalars), host→device uploads (token ids, positions,
//!    block tables) are queued instead of issued; at `to_host` the capture ends, the queued
//!    uploads run, the graph is launched and the result copied back;
//! 3. later calls *replay*: the closure's host code runs as usual (checks, metadata), but no
//!    kernel is launched — each launch's signature is compared with the captured one; at
//!    `to_host` the queued uploads (new positions, tables, ids) go into the same fixed device
//!    buffers and the graph is launched once.
//!
//! Positions, sequence lengths and block tables are read by the kernels from those fixed
//! buffers, and attention splits each row's key range on the device, so a graph stays valid
//! while the batch's shape, buffers and split count stay the same. When anything differs (a
//! signature mismatch, a scratch buffer that would have to grow, a new batch size) the step
//! fails inside, the graph is dropped and the closure is run again eagerly; the call after that
//! captures anew. Up to [`MAX_GRAPHS`] graphs are kept, chosen by their first launch (so
//! several batch sizes can alternate: the engine pads decode steps to a ladder of batch
//! sizes, twelve for 256 sequences); a new capture evicts the one replayed least recently
//! (one whose buffers were reallocated is never replayed again, so it goes first). The
//! closure must therefore be safe to re-run after an error: `Transformer::forward` is (it
//! rolls the cache back on error).

use cudarc::driver::CudaGraph;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

use super::step::{Scratch, graph_changed};
use super::{CudaBackend, cuda_err};
use crate::Error;

/// Graphs kept at once (one per batch shape in use: the engine's default decode buckets for
/// 256 sequences are twelve, and a few more leave room for ones gone stale).
pub(crate) const MAX_GRAPHS: usize = 16;

/// What the launches of the current step do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Launch now (also outside `run_graphed`).
    Eager,
    /// Launch into the stream capture and record signatures.
    Capture,
    /// Check signatures against a captured graph; launch nothing.
    Replay,
}

struct Captured {
    graph: CudaGraph,
    sigs: Vec<u64>,
}

// SAFETY: a CUDA graph and its executable are plain driver handles, valid from any thread of
// the process; `Captured` lives inside the backend's `Mutex<State>`, so it is only touched by
// one thread at a time, and it is launched on the backend's stream, which is itself `Send`.
unsafe impl Send for Captured {}

/// The backend's mutable state: scratch for eager work plus the graph machinery.
#[derive(Default)]
pub(crate) struct State {
    main: Scratch,
    graph_scratch: Scratch,
    /// Inside `run_graphed`: the graph scratch is the active one.
    active: bool,
    mode: Option<Mode>,
    graphs: Vec<Captured>,
    /// Replay: the graph chosen by the first launch, and the next launch's index.
    current: Option<usize>,
    /// The graph launched last (captured or replayed), for [`CudaBackend::graph_gpu_time`].
    last_launched: Option<usize>,
    cursor: usize,
    /// Capture: this step's signatures.
    sigs: Vec<u64>,
    capture_next: bool,
    /// `[tensor, bf16 buffer, rows, cols]`: the last op also wrote bf16(tensor) into the
    /// scratch bf16 buffer, so a matmul reading that tensor next can skip the conversion.
    /// Cleared by every launch.
    pub bf16_of: Option<[u64; 4]>,
    /// The last launch was a GEMV kernel (which lets the next GEMV start early). Cleared by
    /// every launch.
    pub last_gemv: bool,
    /// The last launch was the KV write (which lets a decode attention start early). Cleared
    /// by every launch.
    pub last_write_kv: bool,
    /// Counters (steps replayed, captured, run eagerly inside `run_graphed`).
    pub stats: GraphStats,
    /// Steps ended so far (bumped by every `to_host`): span metadata checked in one step is
    /// re-checked in the next.
    pub epoch: u64,
    /// When the current `run_graphed` step started.
    step_start: Option<std::time::Instant>,
    /// The mixture-of-experts layers' tables of expert weight addresses on the device, each
    /// with its contents (see `ops/moe.rs`), oldest first.
    pub moe_tables: Vec<(Vec<u64>, cudarc::driver::CudaSlice<u64>)>,
}

/// How `run_graphed` steps ran.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GraphStats {
    /// Steps launched as one replayed graph.
    pub replayed: u64,
    /// Steps captured (and launched) as a new graph.
    pub captured: u64,
    /// Steps run eagerly (first of a shape, or after a mismatch).
    pub eager: u64,
    /// Host time of the replayed steps from the start of `run_graphed` to the graph launch
    /// (the step's host code, signature checks, uploads), in seconds: the GPU has none of
    /// the step's work queued meanwhile.
    pub replay_host_s: f64,
    /// The part of `replay_host_s` spent uploading the step's inputs (token ids, positions,
    /// block tables), in seconds.
    pub replay_upload_s: f64,
    /// Host time of the replayed steps' graph launch calls, in seconds.
    pub replay_launch_s: f64,
}

/// Moves `v[i]` to the end, keeping the others' order; returns its new index.
fn to_back<T>(v: &mut Vec<T>, i: usize) -> usize {
    if i < v.len() {
        let x = v.remove(i);
        v.push(x);
    }
    v.len().saturating_sub(1)
}

/// The signature of one launch: a multiply-xorshift hash over its 64-bit words (one round per
/// word, not per byte: with the per-step span cache of `Scratch::prepare_spans` this took
/// the host time before each replayed llama3-8b step on the H200 from 138 to 70 µs).
pub(crate) fn sig(parts: &[u64]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &p in parts {
        h = (h ^ p).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        h ^= h >> 29;
    }
    h
}

impl State {
    /// The scratch buffers of the current step.
    pub(crate) fn sc(&mut self) -> &mut Scratch {
        if self.active {
            &mut self.graph_scratch
        } else {
            &mut self.main
        }
    }

    /// The current launch mode.
    pub(crate) fn mode(&self) -> Mode {
        if self.active {
            self.mode.unwrap_or(Mode::Eager)
        } else {
            Mode::Eager
        }
    }

    /// Admits one launch with signature `s`: `true` to launch it now, `false` to skip it
    /// (replay), an error when it differs from the graph being replayed.
    pub(crate) fn admit(&mut self, s: u64) -> Result<bool, Error> {
        self.bf16_of = None;
        self.last_gemv = false;
        self.last_write_kv = false;
        match self.mode() {
            Mode::Eager => Ok(true),
            Mode::Capture => {
                self.sigs.push(s);
                Ok(true)
            }
            Mode::Replay => {
                if self.cursor == 0 {
                    self.current = self.graphs.iter().position(|g| g.sigs.first() == Some(&s));
                }
                let g = self
                    .current
                    .and_then(|i| self.graphs.get(i))
                    .ok_or_else(|| graph_changed("no graph starts with this launch"))?;
                if g.sigs.get(self.cursor) != Some(&s) {
                    return Err(graph_changed("a launch differs"));
                }
                self.cursor += 1;
                Ok(false)
            }
        }
    }
}

impl CudaBackend {
    /// Runs one step through a CUDA graph (see the module docs). `step` must end with a
    /// `to_host` and be safe to run again after it returned an error.
    pub fn run_graphed<R, E: From<Error>>(
        &self,
        mut step: impl FnMut() -> Result<R, E>,
    ) -> Result<R, E> {
        let mode = {
            let mut st = self.lock_state("graph")?;
            let mode = if !st.graphs.is_empty() && !st.capture_next {
                Mode::Replay
            } else if st.capture_next {
                Mode::Capture
            } else {
                Mode::Eager
            };
            st.active = true;
            st.step_start = Some(std::time::Instant::now());
            st.mode = Some(mode);
            st.current = None;
            st.cursor = 0;
            st.sigs.clear();
            let sc = &mut st.graph_scratch;
            sc.discard_pending();
            sc.defer = mode != Mode::Eager;
            mode
        };
        if mode == Mode::Capture
            && let Err(e) = self
                .stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        {
            self.leave_graph_mode(false, false)?;
            return Err(cuda_err("begin capture")(e).into());
        }
        let first = step();
        // A capture still open means the step failed before `to_host`: discard it.
        let still_capturing = {
            let st = self.lock_state("graph")?;
            st.mode == Some(Mode::Capture)
        };
        if still_capturing {
            let _ = self.stream.end_capture(
                CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            );
        }
        match first {
            Ok(r) => {
                self.leave_graph_mode(mode == Mode::Eager, mode == Mode::Eager)?;
                Ok(r)
            }
            Err(e) if mode == Mode::Eager => {
                self.leave_graph_mode(false, true)?;
                Err(e)
            }
            Err(_) => {
                // Drop the graph that did not fit and run the step eagerly on the graph's
                // scratch (growing it), so that the next call can capture.
                {
                    let mut st = self.lock_state("graph")?;
                    if mode == Mode::Replay
                        && let Some(i) = st.current
                        && i < st.graphs.len()
                    {
                        st.graphs.remove(i);
                        st.last_launched = None;
                    }
                    st.mode = Some(Mode::Eager);
                    st.capture_next = false;
                    let sc = &mut st.graph_scratch;
                    sc.discard_pending();
                    sc.defer = false;
                }
                let r = step();
                self.leave_graph_mode(r.is_ok(), true)?;
                r
            }
        }
    }

    fn leave_graph_mode(&self, capture_next: bool, ran_eager: bool) -> Result<(), Error> {
        let mut st = self.lock_state("graph")?;
        if ran_eager {
            st.stats.eager += 1;
        }
        st.active = false;
        st.mode = None;
        st.capture_next = capture_next;
        st.graph_scratch.defer = false;
        st.graph_scratch.discard_pending();
        Ok(())
    }

    /// How the steps of `run_graphed` ran so far.
    pub fn graph_stats(&self) -> Result<GraphStats, Error> {
        Ok(self.lock_state("graph")?.stats)
    }

    /// The device's part of a graphed step: launches the graph of the last graphed step
    /// `reps` times back to back (no host code between them, so launch gaps are hidden) and
    /// returns the mean seconds per launch. Each launch repeats that step on the inputs
    /// already on the device: it writes the same KV slots with the same values.
    pub fn graph_gpu_time(&self, reps: usize) -> Result<f64, Error> {
        let st = self.lock_state("graph")?;
        let g = st
            .last_launched
            .and_then(|i| st.graphs.get(i))
            .ok_or_else(|| graph_changed("no graph has run yet"))?;
        self.synchronize()?;
        let t = std::time::Instant::now();
        for _ in 0..reps.max(1) {
            g.graph.launch().map_err(cuda_err("graph launch"))?;
        }
        self.synchronize()?;
        Ok(t.elapsed().as_secs_f64() / reps.max(1) as f64)
    }

    /// Drops every captured graph (the next `run_graphed` runs eagerly, then recaptures).
    pub fn clear_graphs(&self) -> Result<(), Error> {
        let mut st = self.lock_state("graph")?;
        st.graphs.clear();
        st.last_launched = None;
        st.capture_next = false;
        Ok(())
    }

    /// Ends a captured or replayed step before its result is copied back: finishes the
    /// capture, performs the queued uploads, launches the graph. A no-op when eager.
    pub(crate) fn finish_graph_step(&self, st: &mut State) -> Result<(), Error> {
        match st.mode() {
            Mode::Eager => Ok(()),
            Mode::Capture => {
                let graph = self
                    .stream
                    .end_capture(
                        CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
                    )
                    .map_err(cuda_err("end capture"))?
                    .ok_or_else(|| graph_changed("empty capture"))?;
                st.mode = Some(Mode::Eager);
                st.graph_scratch.flush(&self.stream, &self.k.upload_words)?;
                graph.launch().map_err(cuda_err("graph launch"))?;
                if st.graphs.len() >= MAX_GRAPHS {
                    st.graphs.remove(0);
                }
                let sigs = std::mem::take(&mut st.sigs);
                st.graphs.push(Captured { graph, sigs });
                st.last_launched = Some(st.graphs.len() - 1);
                st.stats.captured += 1;
                Ok(())
            }
            Mode::Replay => {
                let i = st
                    .current
                    .filter(|&i| st.graphs.get(i).is_some_and(|g| g.sigs.len() == st.cursor))
                    .ok_or_else(|| graph_changed("fewer launches than the graph"))?;
                let t_upload = std::time::Instant::now();
                st.graph_scratch.flush(&self.stream, &self.k.upload_words)?;
                let t_launch = std::time::Instant::now();
                st.stats.replay_upload_s += (t_launch - t_upload).as_secs_f64();
                if let Some(t) = st.step_start {
                    st.stats.replay_host_s += (t_launch - t).as_secs_f64();
                }
                st.graphs[i]
                    .graph
                    .launch()
                    .map_err(cuda_err("graph launch"))?;
                st.stats.replay_launch_s += t_launch.elapsed().as_secs_f64();
                // Most recently used last: a capture evicts from the front.
                let i = to_back(&mut st.graphs, i);
                st.current = Some(i);
                st.last_launched = Some(i);
                st.mode = Some(Mode::Eager);
                st.stats.replayed += 1;
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_separate_orders_and_values() {
        assert_ne!(sig(&[1, 2]), sig(&[2, 1]));
        assert_ne!(sig(&[1]), sig(&[1, 0]));
        assert_eq!(sig(&[7, 8]), sig(&[7, 8]));
    }

    #[test]
    fn a_replayed_graph_moves_behind_the_others() {
        let mut v = vec!['a', 'b', 'c', 'd'];
        assert_eq!(to_back(&mut v, 1), 3);
        assert_eq!(v, ['a', 'c', 'd', 'b']);
        // The least recently replayed is the first, which a capture at capacity evicts.
        assert_eq!(to_back(&mut v, 0), 3);
        assert_eq!(v, ['c', 'd', 'b', 'a']);
        assert_eq!(to_back(&mut v, 3), 3);
        assert_eq!(v, ['c', 'd', 'b', 'a']);
    }

    #[test]
    fn eager_state_launches_everything() {
        let mut st = State::default();
        assert_eq!(st.mode(), Mode::Eager);
        assert!(st.admit(1).unwrap());
        st.active = true;
        st.mode = Some(Mode::Replay);
        assert!(st.admit(1).is_err(), "no graph to replay");
    }
}
