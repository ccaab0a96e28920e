//! One description per launch: an op lists its kernel launches (function, grid, block, shared
//! memory, PDL and every argument, in the kernel's parameter order) and cuBLAS GEMMs once, in
//! a [`Launches`]; the same list yields the kernels' parameter arrays and the graph-replay
//! signature (`graph.rs`). So a value that changes a launch cannot be left out of the
//! signature: a replayed graph never runs with stale arguments.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{CudaFunction, CudaStream, DriverError, LaunchConfig, sys};

use super::graph::sig;
use super::{CudaBackend, cuda_err};
use crate::Error;

/// A value a kernel takes as one parameter, by value.
///
/// # Safety
/// `Self` has the layout of the kernel parameter it is passed as (`repr(C)` for structs), an
/// alignment of at most 8, and no padding bytes (every byte is initialised, so its bytes can
/// be hashed into the launch signature).
pub(crate) unsafe trait KernelArg: Copy {}

// SAFETY: C `int`, `unsigned`, `float`, and 64-bit integers / device pointers.
unsafe impl KernelArg for i32 {}
// SAFETY: as above.
unsafe impl KernelArg for u32 {}
// SAFETY: as above.
unsafe impl KernelArg for f32 {}
// SAFETY: as above.
unsafe impl KernelArg for u64 {}

/// A kernel's arguments in parameter order, each stored in its own 8-byte-aligned slots.
#[derive(Clone, Debug, Default)]
pub(crate) struct KernelArgs {
    /// The values' bytes, each value starting on a fresh word (unused bytes zero).
    words: Vec<u64>,
    /// The first word of each value.
    starts: Vec<usize>,
}

impl KernelArgs {
    /// Appends the next parameter.
    pub fn arg<T: KernelArg>(&mut self, v: T) -> &mut Self {
        const { assert!(std::mem::align_of::<T>() <= 8) };
        let n = std::mem::size_of::<T>().div_ceil(8).max(1);
        let start = self.words.len();
        self.words.resize(start + n, 0);
        // SAFETY: the `n` words from `start` are `n · 8 ≥ size_of::<T>()` bytes inside the
        // vector, 8-aligned (≥ T's alignment, checked above).
        unsafe { self.words.as_mut_ptr().add(start).cast::<T>().write(v) };
        self.starts.push(start);
        self
    }

    /// A device address parameter (any pointer type in the kernel).
    pub fn ptr(&mut self, addr: u64) -> &mut Self {
        self.arg(addr)
    }

    /// The signature words: the count, then every value's bytes as words.
    fn sig_words(&self, out: &mut Vec<u64>) {
        out.push(self.starts.len() as u64);
        out.extend_from_slice(&self.words);
    }

    /// The parameter array of `cuLaunchKernelEx`: a pointer to each value, valid while `self`
    /// is neither moved nor changed.
    fn params(&mut self) -> Vec<*mut c_void> {
        let base = self.words.as_mut_ptr();
        self.starts
            .iter()
            // SAFETY: every start is an index inside `words`.
            .map(|&s| unsafe { base.add(s) }.cast::<c_void>())
            .collect()
    }
}

/// One kernel launch, fully described.
#[derive(Debug)]
pub(crate) struct Kernel<'f> {
    name: &'static str,
    f: &'f CudaFunction,
    cfg: LaunchConfig,
    pdl: bool,
    args: KernelArgs,
}

/// One cuBLAS GEMM of the backend's configuration: `y[t, 0 .. n] (+)= x · Wᵀ` (W: `[n, k]`
/// bf16 at `w`; x: `t` bf16 rows of width `k` at `x`; y: f32 rows of stride `ldy` at `y`;
/// f32 accumulate).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlasGemm {
    pub w: u64,
    pub n: i32,
    pub t: i32,
    pub k: i32,
    pub x: u64,
    pub y: u64,
    pub ldy: i32,
    pub accumulate: bool,
}

#[derive(Debug)]
enum Item<'f> {
    Kernel(Kernel<'f>),
    Gemm(BlasGemm),
}

/// The launches of one op, in order: what it runs and what its graph signature covers.
#[derive(Debug)]
pub(crate) struct Launches<'f> {
    op: u64,
    items: Vec<Item<'f>>,
}

impl<'f> Launches<'f> {
    /// An empty list for op code `op` (`ops::opc`).
    pub fn new(op: u64) -> Self {
        Self {
            op,
            items: Vec::new(),
        }
    }

    /// Appends a launch of `f` (`name` for errors); push its arguments into the result.
    pub fn kernel(
        &mut self,
        name: &'static str,
        f: &'f CudaFunction,
        cfg: LaunchConfig,
        pdl: bool,
    ) -> &mut KernelArgs {
        self.items.push(Item::Kernel(Kernel {
            name,
            f,
            cfg,
            pdl,
            args: KernelArgs::default(),
        }));
        match self.items.last_mut() {
            Some(Item::Kernel(k)) => &mut k.args,
            _ => unreachable!("a kernel was just pushed"),
        }
    }

    /// Appends a cuBLAS GEMM.
    pub fn gemm(&mut self, g: BlasGemm) {
        self.items.push(Item::Gemm(g));
    }

    /// The graph-replay signature: the op code, then for each launch its kind, function,
    /// grid, block, shared memory, PDL flag and every argument's bits.
    pub fn signature(&self) -> u64 {
        let mut w = vec![self.op, self.items.len() as u64];
        for item in &self.items {
            match item {
                Item::Kernel(k) => {
                    let c = &k.cfg;
                    w.extend([
                        1,
                        k.f.cu_function() as usize as u64,
                        u64::from(c.grid_dim.0),
                        u64::from(c.grid_dim.1),
                        u64::from(c.grid_dim.2),
                        u64::from(c.block_dim.0),
                        u64::from(c.block_dim.1),
                        u64::from(c.block_dim.2),
                        u64::from(c.shared_mem_bytes),
                        u64::from(k.pdl),
                    ]);
                    k.args.sig_words(&mut w);
                }
                Item::Gemm(g) => w.extend([
                    2,
                    g.w,
                    g.n as u64,
                    g.t as u64,
                    g.k as u64,
                    g.x,
                    g.y,
                    g.ldy as u64,
                    u64::from(g.accumulate),
                ]),
            }
        }
        sig(&w)
    }
}

/// Launches `f` on `stream` with the raw parameter array `params`; with `pdl`, with
/// programmatic stream serialization: its blocks may start once every block of the kernel
/// ahead has run `griddepcontrol.launch_dependents` (or exited).
///
/// # Safety
/// `params` point at the kernel's arguments in order, with their exact types, and the launch
/// must be valid for `cfg`; with `pdl`, the kernel must `griddepcontrol.wait` before touching
/// memory that the kernels ahead of it write.
pub(crate) unsafe fn launch_raw(
    stream: &Arc<CudaStream>,
    f: &CudaFunction,
    cfg: LaunchConfig,
    params: &mut [*mut c_void],
    pdl: bool,
) -> Result<(), DriverError> {
    let mut value = sys::CUlaunchAttributeValue { pad: [0; 64] };
    value.programmaticStreamSerializationAllowed = 1;
    let mut attr = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value,
    };
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: u32::from(pdl),
    };
    stream.context().bind_to_thread()?;
    // SAFETY: the config, attribute and parameters outlive the call; see the contract.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}

/// Launches one kernel described by `args` (see [`launch_raw`]).
///
/// # Safety
/// `args` are the kernel's parameters in order with their exact types, the launch is valid
/// for `cfg`, and with `pdl` the kernel waits (`griddepcontrol.wait`) before touching memory
/// the kernels ahead of it write.
pub(crate) unsafe fn launch_kernel(
    stream: &Arc<CudaStream>,
    name: &'static str,
    f: &CudaFunction,
    cfg: LaunchConfig,
    pdl: bool,
    args: &mut KernelArgs,
) -> Result<(), Error> {
    let mut params = args.params();
    // SAFETY: `params` point into `args`, alive and unchanged until the call returns; the
    // rest is the caller's contract.
    unsafe { launch_raw(stream, f, cfg, &mut params, pdl) }.map_err(cuda_err(name))
}

impl CudaBackend {
    /// Runs an op's launches in order.
    ///
    /// # Safety
    /// Every kernel's arguments match its parameters in order and type, every launch is valid
    /// for its configuration (buffers at least as large as the kernel touches), every PDL
    /// kernel waits before touching what the kernels ahead of it write, and every GEMM's
    /// buffers hold the matrices it names.
    pub(crate) unsafe fn launch(&self, l: &mut Launches<'_>) -> Result<(), Error> {
        for item in &mut l.items {
            match item {
                Item::Kernel(k) => {
                    // SAFETY: the caller's contract.
                    unsafe { launch_kernel(&self.stream, k.name, k.f, k.cfg, k.pdl, &mut k.args) }?
                }
                // SAFETY: the caller's contract.
                Item::Gemm(g) => unsafe { self.blas_gemm(g) }?,
            }
        }
        Ok(())
    }

    /// One cuBLAS GEMM (see [`BlasGemm`]).
    ///
    /// # Safety
    /// The buffers at `g.w`, `g.x`, `g.y` hold the matrices `g` names.
    pub(crate) unsafe fn blas_gemm(&self, g: &BlasGemm) -> Result<(), Error> {
        let (alpha, beta) = (1f32, if g.accumulate { 1f32 } else { 0f32 });
        // SAFETY: W is [n, k] bf16, x is [t, k] bf16, y has t rows of ldy ≥ n f32 (the
        // caller's contract); alpha/beta are host scalars (default pointer mode).
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                g.n,
                g.t,
                g.k,
                (&alpha as *const f32).cast(),
                g.w as *const _,
                cudaDataType::CUDA_R_16BF,
                g.k,
                g.x as *const _,
                cudaDataType::CUDA_R_16BF,
                g.k,
                (&beta as *const f32).cast(),
                g.y as *mut _,
                cudaDataType::CUDA_R_32F,
                g.ldy,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(cuda_err("cublas gemm"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Pair {
        a: u64,
        b: i32,
        c: i32,
    }
    // SAFETY: repr(C), 8-aligned, no padding (8 + 4 + 4 bytes).
    unsafe impl KernelArg for Pair {}

    #[test]
    fn arguments_keep_their_bytes_in_order() {
        let mut a = KernelArgs::default();
        a.arg(7i32)
            .ptr(0xdead_beef_0000)
            .arg(1.5f32)
            .arg(Pair { a: 1, b: 2, c: 3 });
        let p = a.params();
        assert_eq!(p.len(), 4);
        // SAFETY: each pointer points at the value pushed as that type.
        unsafe {
            assert_eq!(*p[0].cast::<i32>(), 7);
            assert_eq!(*p[1].cast::<u64>(), 0xdead_beef_0000);
            assert_eq!(*p[2].cast::<f32>(), 1.5);
            let q = *p[3].cast::<Pair>();
            assert_eq!((q.a, q.b, q.c), (1, 2, 3));
        }
        let mut w = Vec::new();
        a.sig_words(&mut w);
        assert_eq!(w[0], 4);
        assert_eq!(w[1], 7);
        assert_eq!(w[3], u64::from(1.5f32.to_bits()));
    }

    #[test]
    fn every_argument_and_gemm_field_reaches_the_signature() {
        let base = |x: i32| {
            let mut l = Launches::new(9);
            l.gemm(BlasGemm {
                w: 1,
                n: x,
                t: 2,
                k: 8,
                x: 3,
                y: 4,
                ldy: 5,
                accumulate: false,
            });
            l.signature()
        };
        assert_eq!(base(1), base(1));
        assert_ne!(base(1), base(2));
        let args = |v: f32| {
            let mut a = KernelArgs::default();
            a.arg(1u64).arg(v);
            let mut w = Vec::new();
            a.sig_words(&mut w);
            w
        };
        assert_ne!(args(0.5), args(0.25));
        let mut a = Launches::new(1);
        let mut b = Launches::new(2);
        let g = BlasGemm {
            w: 0,
            n: 1,
            t: 1,
            k: 8,
            x: 0,
            y: 0,
            ldy: 1,
            accumulate: true,
        };
        a.gemm(g);
        b.gemm(g);
        assert_ne!(a.signature(), b.signature(), "the op code counts");
    }
}
