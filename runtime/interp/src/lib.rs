//! The reference interpreter: executes any IR graph on the CPU, plainly and obviously right.
//! It is the oracle that every pass and back end is tested against.

mod tensor;

pub use tensor::{Data, Tensor};
