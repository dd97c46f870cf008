//! Kernels that compute the same thing on the same shapes, up to the buffers they read and
//! write, become one function: a chain of a thousand identical layers has a handful of distinct
//! kernels, each compiled once and called with each layer's buffers.
//!
//! A kernel's canonical form is what its generated code depends on (`kernel::emit`), with node
//! ids replaced by positions: each input's type (and, for a constant, its value, which codegen
//! may fold into the code), then each member's op, output types and operands (an earlier
//! member's output or an input, by position). Names and ids are left out; two kernels with
//! equal forms get equal code, in one partition or in two compiled together.

use dfc_ir::{Module, NodeId, Op, TensorRef};
use dfc_passes::Kernel;
use serde::Serialize;
use std::collections::HashMap;

/// For each kernel of each module, the first kernel with its canonical form, as (module,
/// kernel) indices (itself if it is the first).
pub fn representatives(modules: &[&Module], kernels: &[Vec<Kernel>]) -> Vec<Vec<(usize, usize)>> {
    let mut first: HashMap<Vec<u8>, (usize, usize)> = HashMap::new();
    modules
        .iter()
        .zip(kernels)
        .enumerate()
        .map(|(p, (module, kernels))| {
            kernels
                .iter()
                .enumerate()
                .map(|(i, kernel)| *first.entry(form(module, p, kernel)).or_insert((p, i)))
                .collect()
        })
        .collect()
}

/// Where a member's operand comes from, by position within the kernel.
#[derive(Serialize)]
enum Operand {
    Member { index: usize, port: u32 },
    Input(usize),
    Outside { module: usize, node: usize, port: u32 },
}

/// The canonical form of `kernel`, of module number `p`.
fn form(module: &Module, p: usize, kernel: &Kernel) -> Vec<u8> {
    let graph = &module.graph;
    let member_index: HashMap<NodeId, usize> = kernel.members.iter().enumerate().map(|(i, &m)| (m, i)).collect();
    let operand = |tensor: TensorRef| match member_index.get(&tensor.node) {
        Some(&index) => Operand::Member { index, port: tensor.port },
        None => match kernel.inputs.iter().position(|&input| input == tensor) {
            Some(position) => Operand::Input(position),
            // Not expected (fusion lists every outside operand); a form that names the node
            // matches no other kernel's, so the kernel still gets its own code.
            None => Operand::Outside { module: p, node: tensor.node.index(), port: tensor.port },
        },
    };
    let mut bytes = Vec::new();
    for &input in &kernel.inputs {
        let op = &graph.node(input.node).op;
        let constant = matches!(op, Op::Const { .. }).then_some(op);
        bytes = append(bytes, &(graph.ty(input), constant));
    }
    for &member in &kernel.members {
        let node = graph.node(member);
        let operands: Vec<Operand> = graph.inputs(member).into_iter().map(operand).collect();
        bytes = append(bytes, &(&node.op, &node.outputs, operands));
    }
    bytes
}

/// `bytes` and then `value`'s postcard encoding (which, the types being fixed, delimits itself).
fn append(bytes: Vec<u8>, value: &impl Serialize) -> Vec<u8> {
    postcard::to_extend(value, bytes).expect("IR values encode")
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: &str = "model m {
        input x: f32[4, 3]
        input p: f32[4, 3]
        input q: f32[4, 3]
        input r: f32[4, 4]
        let same_as_x = exp(p) * 2.0 + 1.0
        let from_x = exp(x) * 2.0 + 1.0
        let other_constant = exp(q) * 3.0 + 1.0
        let other_shape = exp(r) * 2.0 + 1.0
        let reads_twice = exp(x) * 2.0 + x
        output same_as_x
        output from_x
        output other_constant
        output other_shape
        output reads_twice
    }";

    /// The kernel of each output, by the output's name.
    fn kernels() -> (Module, Vec<Kernel>, HashMap<String, usize>) {
        let (module, diagnostics) = dfc_sema::compile_source(SOURCE, None, &Default::default());
        let module = module.unwrap_or_else(|| panic!("{diagnostics:?}"));
        let kernels = dfc_passes::fuse(&module, &[]).kernels;
        let by_output = module
            .outputs
            .iter()
            .map(|output| {
                let i = kernels.iter().position(|k| k.root == output.tensor.node).expect("an output is a kernel root");
                (output.name.clone(), i)
            })
            .collect();
        (module, kernels, by_output)
    }

    #[test]
    fn kernels_alike_up_to_their_buffers_share_a_representative() {
        let (module, kernels, at) = kernels();
        let representative = representatives(&[&module], std::slice::from_ref(&kernels));
        let of = |name: &str| representative[0][at[name]].1;
        assert_eq!(of("same_as_x"), of("from_x"));
        for other in ["other_constant", "other_shape", "reads_twice"] {
            assert_ne!(of(other), of("from_x"), "{other}");
            assert_eq!(of(other), at[other], "{other} is its own representative");
        }
    }

    #[test]
    fn kernels_alike_in_partitions_compiled_together_are_one_function() {
        let (module, _, at) = kernels();
        let other = "model n { input a: f32[4, 3]\n let b = exp(a) * 2.0 + 1.0\n output b }";
        let (other, diagnostics) = dfc_sema::compile_source(other, None, &Default::default());
        let other = other.unwrap_or_else(|| panic!("{diagnostics:?}"));
        let code = crate::compile_group(&[(&module, &[]), (&other, &[])], &crate::host_target()).unwrap();
        assert_eq!(code.partitions.len(), 2);
        assert_eq!(code.partitions[1].len(), 1);
        assert_eq!(code.partitions[1][0].function, code.partitions[0][at["from_x"]].function);
    }

    #[test]
    fn kernels_alike_are_one_function_in_the_code() {
        let (module, _, at) = kernels();
        let code = crate::compile(&module, &[], &crate::host_target()).expect("the module compiles");
        let kernels = &code.partitions[0];
        let function = |name: &str| kernels[at[name]].function.clone();
        assert_eq!(function("same_as_x"), function("from_x"));
        assert_ne!(function("other_constant"), function("from_x"));
        assert_ne!(kernels[at["same_as_x"]].inputs, kernels[at["from_x"]].inputs);
    }
}
