//! Tensors as the runtime holds them: a shape and row-major data of one element type.

use dfc_ir::{ConstValue, DType, Shape, TensorType};

/// The element storage is the IR's constant data: a constant and a runtime tensor hold the
/// same thing.
pub use dfc_ir::ConstData as Data;

/// The element types a tensor can hold, tying each Rust type to its `DType` and `Data` variant.
pub trait Element: Copy + PartialEq + PartialOrd + Default + std::fmt::Debug + Send + Sync + 'static {
    const DTYPE: DType;
    fn into_data(values: Vec<Self>) -> Data;
    fn slice(data: &Data) -> Option<&[Self]>;
}

macro_rules! element {
    ($t:ty, $variant:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$variant;
            fn into_data(values: Vec<Self>) -> Data {
                Data::$variant(values)
            }
            fn slice(data: &Data) -> Option<&[Self]> {
                match data {
                    Data::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}

element!(f32, F32);
element!(f64, F64);
element!(i32, I32);
element!(i64, I64);
element!(u8, U8);
element!(bool, Bool);

#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Shape,
    pub data: Data,
}

impl Tensor {
    /// A tensor of `shape` holding `values` of one element type: `Tensor::from_vec(vec![2], vec![1.0f32, 2.0])`.
    /// The element count must match the shape.
    pub fn from_vec<T: Element>(shape: impl Into<Shape>, values: Vec<T>) -> Tensor {
        Tensor::new(shape, T::into_data(values))
    }

    /// A scalar (rank 0) holding `value`.
    pub fn scalar<T: Element>(value: T) -> Tensor {
        Tensor::from_vec(Shape::scalar(), vec![value])
    }

    /// The elements, if they are of type `T`.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        T::slice(&self.data)
    }

    /// The elements as a `Vec<T>`. Panics if the element type is not `T` (a convenience for
    /// tests and tools that know the type).
    pub fn to_vec<T: Element>(&self) -> Vec<T> {
        match self.as_slice::<T>() {
            Some(values) => values.to_vec(),
            None => panic!("a {} tensor does not hold {} elements", self.ty(), T::DTYPE),
        }
    }

    /// A tensor of `shape` holding `data`; the element count must match.
    pub fn new(shape: impl Into<Shape>, data: Data) -> Tensor {
        let shape = shape.into();
        let tensor = Tensor { shape, data };
        assert_eq!(tensor.len(), tensor.shape.n_elements(), "data length does not match the shape {}", tensor.shape);
        tensor
    }

    pub fn zeros(ty: &TensorType) -> Tensor {
        let n = ty.shape.n_elements();
        let data = match ty.dtype {
            DType::F32 => Data::F32(vec![0.0; n]),
            DType::F64 => Data::F64(vec![0.0; n]),
            DType::I32 => Data::I32(vec![0; n]),
            DType::I64 => Data::I64(vec![0; n]),
            DType::U8 => Data::U8(vec![0; n]),
            DType::Bool => Data::Bool(vec![false; n]),
        };
        Tensor { shape: ty.shape.clone(), data }
    }

    /// `values` converted to `dtype` as Rust's `as` converts.
    pub fn from_f64(dtype: DType, shape: impl Into<Shape>, values: &[f64]) -> Tensor {
        let value = ConstValue::from_f64(dtype, shape.into(), values);
        Tensor::from_const(&value)
    }

    pub fn from_const(value: &ConstValue) -> Tensor {
        Tensor::new(value.shape.clone(), value.data.clone())
    }

    pub fn dtype(&self) -> DType {
        match self.data {
            Data::F32(_) => DType::F32,
            Data::F64(_) => DType::F64,
            Data::I32(_) => DType::I32,
            Data::I64(_) => DType::I64,
            Data::U8(_) => DType::U8,
            Data::Bool(_) => DType::Bool,
        }
    }

    pub fn ty(&self) -> TensorType {
        TensorType::new(self.dtype(), self.shape.clone())
    }

    pub fn len(&self) -> usize {
        match &self.data {
            Data::F32(v) => v.len(),
            Data::F64(v) => v.len(),
            Data::I32(v) => v.len(),
            Data::I64(v) => v.len(),
            Data::U8(v) => v.len(),
            Data::Bool(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rows `rows` of the tensor along axis 0 (one contiguous run of its row-major data), as a
    /// tensor of their own. Panics if they are not all rows of it, or it is a scalar.
    pub fn rows(&self, rows: std::ops::Range<usize>) -> Tensor {
        let dims = self.shape.dims();
        assert!(!dims.is_empty() && rows.start <= rows.end && rows.end <= dims[0], "rows {rows:?} of {}", self.ty());
        let row: usize = dims[1..].iter().product();
        let span = rows.start * row..rows.end * row;
        let data = match &self.data {
            Data::F32(v) => Data::F32(v[span].to_vec()),
            Data::F64(v) => Data::F64(v[span].to_vec()),
            Data::I32(v) => Data::I32(v[span].to_vec()),
            Data::I64(v) => Data::I64(v[span].to_vec()),
            Data::U8(v) => Data::U8(v[span].to_vec()),
            Data::Bool(v) => Data::Bool(v[span].to_vec()),
        };
        let mut shape = dims.to_vec();
        shape[0] = rows.len();
        Tensor::new(shape, data)
    }

    /// Every element as f64 (exact for all types but i64 beyond 2^53).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match &self.data {
            Data::F32(v) => v.iter().map(|&x| x as f64).collect(),
            Data::F64(v) => v.clone(),
            Data::I32(v) => v.iter().map(|&x| x as f64).collect(),
            Data::I64(v) => v.iter().map(|&x| x as f64).collect(),
            Data::U8(v) => v.iter().map(|&x| x as f64).collect(),
            Data::Bool(v) => v.iter().map(|&x| f64::from(u8::from(x))).collect(),
        }
    }

    /// A scalar's value as f64. Panics if the tensor is not a single element.
    pub fn scalar_f64(&self) -> f64 {
        assert_eq!(self.len(), 1, "not a scalar: {}", self.ty());
        self.to_f64_vec()[0]
    }

    /// The raw little-endian bytes of the data (for checkpoints and .npy).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match &self.data {
            Data::F32(v) => le_bytes(v, |x| x.to_le_bytes()),
            Data::F64(v) => le_bytes(v, |x| x.to_le_bytes()),
            Data::I32(v) => le_bytes(v, |x| x.to_le_bytes()),
            Data::I64(v) => le_bytes(v, |x| x.to_le_bytes()),
            Data::U8(v) => v.clone(),
            Data::Bool(v) => v.iter().map(|&x| u8::from(x)).collect(),
        }
    }

    /// The elements' memory as their little-endian bytes, to read and write in place: numbers
    /// on a little-endian machine; `None` for booleans or on a big-endian one.
    pub fn le_bytes_mut(&mut self) -> Option<&mut [u8]> {
        fn bytes<T: Copy>(values: &mut [T]) -> &mut [u8] {
            // SAFETY: T is a primitive number: its memory is initialised, any bit pattern of it
            // is a valid T, and u8 has no alignment to keep.
            unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(values)) }
        }
        if cfg!(target_endian = "big") {
            return None;
        }
        match &mut self.data {
            Data::F32(v) => Some(bytes(v)),
            Data::F64(v) => Some(bytes(v)),
            Data::I32(v) => Some(bytes(v)),
            Data::I64(v) => Some(bytes(v)),
            Data::U8(v) => Some(v),
            Data::Bool(_) => None,
        }
    }

    /// The inverse of `to_le_bytes`; `None` if the byte count does not fit the type.
    pub fn from_le_bytes(ty: &TensorType, bytes: &[u8]) -> Option<Tensor> {
        let n = ty.shape.n_elements();
        if bytes.len() != n.checked_mul(ty.dtype.size_in_bytes())? {
            return None;
        }
        fn chunks<const N: usize, T: Copy>(bytes: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
            if cfg!(target_endian = "little") {
                let n = bytes.len() / N;
                let mut out: Vec<T> = Vec::with_capacity(n);
                // SAFETY: on a little-endian machine the bytes are the elements' own
                // representation (T is a primitive number of N bytes, any bit pattern valid);
                // the copy fills exactly n elements of the allocation.
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.as_mut_ptr().cast::<u8>(), n * N);
                    out.set_len(n);
                }
                return out;
            }
            bytes.chunks_exact(N).map(|c| f(c.try_into().expect("exact chunks"))).collect()
        }
        let data = match ty.dtype {
            DType::F32 => Data::F32(chunks(bytes, f32::from_le_bytes)),
            DType::F64 => Data::F64(chunks(bytes, f64::from_le_bytes)),
            DType::I32 => Data::I32(chunks(bytes, i32::from_le_bytes)),
            DType::I64 => Data::I64(chunks(bytes, i64::from_le_bytes)),
            DType::U8 => Data::U8(bytes.to_vec()),
            DType::Bool => Data::Bool(bytes.iter().map(|&b| b != 0).collect()),
        };
        Some(Tensor { shape: ty.shape.clone(), data })
    }
}

/// The little-endian bytes of numbers: one copy of their memory on a little-endian machine.
fn le_bytes<T: Copy, const N: usize>(values: &[T], f: fn(&T) -> [u8; N]) -> Vec<u8> {
    if cfg!(target_endian = "little") {
        let len = std::mem::size_of_val(values);
        let mut out: Vec<u8> = Vec::with_capacity(len);
        // SAFETY: T is a primitive number of N bytes whose memory is its little-endian bytes here;
        // the copy fills exactly `len` bytes of the allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(values.as_ptr().cast::<u8>(), out.as_mut_ptr(), len);
            out.set_len(len);
        }
        return out;
    }
    values.iter().flat_map(f).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_a_contiguous_run_along_axis_0() {
        let t = Tensor::from_vec(vec![4, 2, 3], (0..24).collect::<Vec<i32>>());
        let middle = t.rows(1..3);
        assert_eq!(middle.shape.dims(), [2, 2, 3]);
        assert_eq!(middle.to_vec::<i32>(), (6..18).collect::<Vec<i32>>());
        assert_eq!(t.rows(2..2).shape.dims(), [0, 2, 3]);
        let flags = Tensor::from_vec(vec![3], vec![true, false, true]);
        assert_eq!(flags.rows(2..3).to_vec::<bool>(), [true]);
    }
}
