//! After a first call has sized the scratch buffer, the kernels allocate nothing (`sgemm`
//! included): this test counts every allocation of the process (its only test, so nothing
//! else runs meanwhile), with the kernels called from inside a rayon pool of 2 threads.

use dfc_kernels::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator, counting.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations made by `f`.
fn allocations(mut f: impl FnMut()) -> usize {
    let before = ALLOCATIONS.load(Ordering::SeqCst);
    f();
    ALLOCATIONS.load(Ordering::SeqCst) - before
}

#[test]
fn kernels_allocate_nothing_after_the_first_call() {
    let n = 16;
    let g1 = Conv2dGeometry::new([n, 28, 28, 1], [3, 3, 1, 32], [1, 1], Padding::Valid);
    let p1 = PoolGeometry::new(g1.output_dims(), [2, 2], [2, 2], Padding::Valid);
    let g2 = Conv2dGeometry::new(p1.output_dims(), [3, 3, 32, 64], [1, 1], Padding::Same);
    let p2 = PoolGeometry::new(g2.output_dims(), [3, 3], [2, 2], Padding::Same);
    let x = vec![0.5f32; g1.input_len()];
    let f1 = vec![0.25f32; g1.filter_len()];
    let f2 = vec![0.125f32; g2.filter_len()];
    let mut y1 = vec![0.0; g1.output_len()];
    let mut a1 = vec![0.0; p1.output_len()];
    let mut y2 = vec![0.0; g2.output_len()];
    let mut a2 = vec![0.0; p2.output_len()];
    let mut d_y2 = vec![0.0; g2.output_len()];
    let mut d_a1 = vec![0.0; g2.input_len()];
    let mut d_f2 = vec![0.0; g2.filter_len()];
    let mut d_y1 = vec![0.0; g1.output_len()];
    let mut d_f1 = vec![0.0; g1.filter_len()];
    let mut table_out = vec![0.0f32; 300 * 64];
    let table = vec![1.0f32; 1000 * 64];
    let indices: Vec<i32> = (0..300).map(|i| i * 3).collect();
    let mut scattered = vec![0.0f32; 1000 * 64];
    let mut transposed = vec![0.0f32; g2.output_len()];
    let mut padded = vec![0.0f32; n * 17 * 17 * 64];
    let mut sliced = vec![0.0f32; n * 5 * 5 * 64];
    let mut joined = vec![0.0f32; 2 * g2.output_len()];
    let mut scratch = Scratch::new();
    let mut step = || {
        conv2d(&g1, &x, &f1, &mut y1, scratch.get(conv2d_scratch_len(&g1)));
        max_pool(&p1, &y1, &mut a1);
        conv2d(&g2, &a1, &f2, &mut y2, scratch.get(conv2d_scratch_len(&g2)));
        max_pool(&p2, &y2, &mut a2);
        max_pool_grad(&p2, &y2, &a2, &mut d_y2);
        avg_pool(&p2, &y2, &mut a2);
        avg_pool_grad(&p2, &a2, &mut d_y2);
        conv2d_backprop_input(&g2, &f2, &d_y2, &mut d_a1, scratch.get(conv2d_backprop_input_scratch_len(&g2)));
        conv2d_backprop_filter(&g2, &a1, &d_y2, &mut d_f2, scratch.get(conv2d_backprop_filter_scratch_len(&g2)));
        max_pool_grad(&p1, &y1, &d_a1, &mut d_y1);
        conv2d_backprop_filter(&g1, &x, &d_y1, &mut d_f1, scratch.get(conv2d_backprop_filter_scratch_len(&g1)));
        gather(&table, 1000, &indices, &mut table_out).unwrap();
        scatter_add(&indices, &table_out, 1000, &mut scattered).unwrap();
        transpose(&y2, &g2.output_dims(), &[0, 3, 1, 2], &mut transposed);
        pad(&y2, &g2.output_dims(), &[0, 2, 2, 0], &[0, 2, 2, 0], &mut padded);
        slice(&y2, &g2.output_dims(), &[0, 3, 4, 0], &[n, 5, 5, 64], &mut sliced);
        concat(&[&y2[..], &transposed[..]], &[n, 13, 13, 128], 3, &mut joined);
    };
    // Inside the pool: rayon itself allocates a block of its injector queue every 63 jobs sent
    // from outside it.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    let counts: Vec<usize> = pool.install(|| {
        for _ in 0..10 {
            step();
        }
        (0..50).map(|_| allocations(&mut step)).collect()
    });
    // Zero, but for the rare allocation rayon's own bookkeeping (work-stealing deques, epoch
    // garbage) may make under an unlucky schedule; a kernel that allocated would show up
    // in every step.
    assert!(counts.iter().sum::<usize>() <= 2, "allocations per step: {counts:?}");
}
