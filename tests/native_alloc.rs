//! Memory planning: after the first step, a native training step allocates no tensor memory —
//! every intermediate lives in the program's arena, variables are updated in place. What is
//! left is bookkeeping (the fetched loss, a few small vectors per run), measured here with a
//! counting allocator.

use dfc_compile::{compile, CompileOptions};
use dfc_driver::{Backend, Session};
use dfc_interp::Tensor;
use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

static BYTES: AtomicUsize = AtomicUsize::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator, counting on the way.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: `GlobalAlloc::alloc`'s contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above, that is from `System`, with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn a_native_step_allocates_no_tensor_memory_after_the_first() {
    for example in ["mlp", "cnn"] {
        let path = format!("{}/examples/{example}.df", env!("CARGO_MANIFEST_DIR"));
        let source = std::fs::read_to_string(path).unwrap();
        let plan = compile(&source, "x.df", &CompileOptions::default()).unwrap().plan;
        let feeds: HashMap<String, Tensor> = plan
            .inputs
            .iter()
            .map(|i| {
                let n = i.ty.shape.n_elements();
                let t = match i.ty.dtype {
                    dfc_ir::DType::U8 => {
                        Tensor::from_vec(i.ty.shape.dims().to_vec(), (0..n).map(|k| k as u8).collect::<Vec<u8>>())
                    }
                    _ => Tensor::from_vec(
                        i.ty.shape.dims().to_vec(),
                        (0..n).map(|k| (k % 10) as i32).collect::<Vec<i32>>(),
                    ),
                };
                (i.name.clone(), t)
            })
            .collect();
        let training = plan.training.as_ref().unwrap();
        let updates: Vec<&str> = training.updates.iter().map(String::as_str).collect();
        let mut session = Session::with_backend(&plan, 0, Backend::Llvm).unwrap();
        let step = session.program(&[training.loss_node.as_str()], &updates).unwrap();
        // Warm-up: buffers that grow to their largest use (GEMM packing per thread) settle.
        for _ in 0..20 {
            session.run(&step, &feeds).unwrap();
        }
        BYTES.store(0, Ordering::Relaxed);
        LARGEST.store(0, Ordering::Relaxed);
        const STEPS: usize = 10;
        for _ in 0..STEPS {
            session.run(&step, &feeds).unwrap();
        }
        let per_step = BYTES.load(Ordering::Relaxed) / STEPS;
        let largest = LARGEST.load(Ordering::Relaxed);
        // The smallest tensor of either step is 10 f32 (the logits' bias); the activations are
        // hundreds of KiB. Bookkeeping stays far below that.
        assert!(largest < 4096, "{example}: an allocation of {largest} bytes in a step");
        assert!(per_step < 16 * 1024, "{example}: {per_step} bytes allocated per step");
    }
}
