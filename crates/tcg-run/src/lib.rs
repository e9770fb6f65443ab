//! Running a resolved compiled graph without the Python `torch` package.
//!
//! A stored artifact's `model.pt2` holds a wrapper `.so` that exports a C ABI
//! (the AOTInductor model container) and needs only libtorch's shared
//! libraries. This crate opens those libraries at run time (nothing links
//! torch at build time), extracts the entry's `.so` into a private directory,
//! creates the container, binds every constant by fqn from safetensors files
//! after checking it against the artifact's constant table, and runs the graph
//! on caller buffers, returning outputs the caller owns. CPU graphs run on
//! host buffers; CUDA graphs (`sm_NN` artifacts) on device buffers of their
//! device (host buffers are copied in), on the caller's stream, with
//! `libtorch_cuda` and the CUDA runtime opened at run time too. Buffers cross
//! in and out as DLPack tensors ([`dlpack`]) as well as raw addresses.
//!
//! A CPU graph whose `.so` imports only shim set v1 runs on the shim instead
//! (`libtcg_shim.so`, carried inside this crate, no libtorch opened): the
//! runtime is chosen from the artifact ([`runtime`]). A CUDA graph runs on
//! the shim only when asked (`TORCH_COMPILED_GRAPHS_RUNTIME=shim`) until a
//! GPU run verifies that path ([`shim_bind`]).
//!
//! Every failure is a [`tcg_core::Error`] with a stable `run.*` code.

#![deny(missing_docs)]

pub mod call;
pub mod capture;
pub mod cgroup;
pub mod cuda;
pub mod cudart;
pub mod dlpack;
pub mod driver;
pub mod extract;
pub mod graph;
pub mod inputs;
pub mod lora;
pub mod lora_fuse;
pub mod pipeline;
pub mod runtime;
pub mod serve;
pub mod shim_bind;
pub mod shim_runtime;
pub mod shim_set;
mod stdmap;
pub mod torch;
mod warm;
pub mod weights;
pub mod weights_set;

pub use cuda::{Cuda, Device};
pub use graph::{
    BindReport, ConstantBuffer, ContainerConstant, Graph, Input, LoadRequest, WeightsSource,
};
pub use inputs::{Dim, InputFact};
pub use runtime::{Runtime, RuntimeChoice, RuntimeOption};
pub use serve::Served;
pub use torch::{Dtype, OwnedTensor, Torch};
pub use weights_set::WeightsSet;
