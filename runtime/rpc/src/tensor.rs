//! Tensors on the wire: dtype code, dims, little-endian bytes.

use crate::proto;
use dfc_interp::Tensor;
use dfc_ir::{DType, Shape, TensorType};

pub fn dtype_code(dtype: DType) -> u32 {
    DType::ALL.iter().position(|&d| d == dtype).expect("every dtype is in ALL") as u32
}

pub fn dtype_of(code: u32) -> Result<DType, String> {
    DType::ALL.get(code as usize).copied().ok_or_else(|| format!("unknown dtype code {code}"))
}

pub fn to_proto(tensor: &Tensor) -> proto::Tensor {
    proto::Tensor {
        dtype: dtype_code(tensor.dtype()),
        dims: tensor.shape.dims().iter().map(|&d| d as u64).collect(),
        data: tensor.to_le_bytes().into(),
    }
}

/// The type a wire tensor claims, checked to be of a sane size.
pub fn type_of(dtype: u32, dims: &[u64]) -> Result<TensorType, String> {
    let dtype = dtype_of(dtype)?;
    let mut elements: u64 = 1;
    for &d in dims {
        elements = elements.checked_mul(d).filter(|&n| n <= 1 << 40).ok_or("the tensor is impossibly large")?;
    }
    Ok(TensorType::new(dtype, Shape::from(dims.iter().map(|&d| d as usize).collect::<Vec<_>>())))
}

pub fn from_proto(tensor: &proto::Tensor) -> Result<Tensor, String> {
    from_parts(tensor.dtype, &tensor.dims, &tensor.data)
}

pub fn from_parts(dtype: u32, dims: &[u64], data: &[u8]) -> Result<Tensor, String> {
    let ty = type_of(dtype, dims)?;
    Tensor::from_le_bytes(&ty, data)
        .ok_or_else(|| format!("{} bytes do not hold a {ty} (or hold a bool that is not 0 or 1)", data.len()))
}
