//! The fuse pass on every example's training graph: kernels are well formed (one stored root,
//! members its ancestors, inputs from outside), and the fusions that matter happen: bias-add
//! with ReLU, the softmax-cross-entropy gradient chain, updates with their scaling.

use dfc_ir::{Module, NodeId, Op};
use dfc_passes::{fuse, Fusion};
use std::collections::{HashMap, HashSet};

fn example(name: &str) -> Module {
    let path = format!("{}/../../examples/{name}.df", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("example");
    let (analyses, diagnostics) = dfc_sema::check_source(&text, &dfc_sema::Options::default());
    assert!(!diagnostics.iter().any(|d| d.is_error()), "{diagnostics:?}");
    let mut module = analyses.into_iter().next().unwrap().module.unwrap();
    dfc_passes::run_pipeline(&mut module, None);
    module
}

fn check_well_formed(module: &Module, fusion: &Fusion, keep: &[NodeId]) {
    let graph = &module.graph;
    let roots: HashSet<NodeId> = fusion.kernels.iter().map(|k| k.root).collect();
    for kernel in &fusion.kernels {
        assert_eq!(kernel.members.last(), Some(&kernel.root), "the root comes last");
        let members: HashSet<NodeId> = kernel.members.iter().copied().collect();
        let ancestors = graph.ancestors(&[kernel.root]);
        for &m in &kernel.members {
            assert!(ancestors.contains(&m), "a member is an ancestor of its root");
            if m != kernel.root {
                assert!(!roots.contains(&m), "`{}` is both stored and inside a kernel", graph.node(m).name);
                assert!(!keep.contains(&m), "a kept node is stored");
                // Every user of an inside node is inside a kernel that computes it.
                for user in graph.users(m) {
                    let in_some = fusion.kernels.iter().any(|k| k.members.contains(&user) && k.members.contains(&m));
                    assert!(in_some, "`{}` is used outside the kernels that compute it", graph.node(m).name);
                }
            }
        }
        for input in &kernel.inputs {
            assert!(!members.contains(&input.node), "an input is computed outside");
        }
    }
}

fn kernel_with<'f>(module: &Module, fusion: &'f Fusion, root_name: &str) -> &'f dfc_passes::Kernel {
    fusion
        .kernels
        .iter()
        .find(|k| module.graph.node(k.root).name == root_name)
        .unwrap_or_else(|| panic!("no kernel rooted at `{root_name}`"))
}

fn member_ops(module: &Module, kernel: &dfc_passes::Kernel) -> Vec<&'static str> {
    kernel.members.iter().map(|&m| module.graph.node(m).op.name()).collect()
}

#[test]
fn every_example_fuses_into_well_formed_kernels() {
    for name in ["softmax_regression", "mlp", "cnn", "linear_regression", "ridge_regression", "wide_and_deep"] {
        let module = example(name);
        let keep: Vec<NodeId> = module.outputs.iter().map(|o| o.tensor.node).collect();
        let fusion = fuse(&module, &keep);
        assert!(!fusion.kernels.is_empty(), "{name}");
        check_well_formed(&module, &fusion, &keep);
        // Fusion stores fewer values than there are elementwise nodes.
        let fused: usize = fusion.kernels.iter().map(|k| k.members.len()).sum();
        assert!(fused > fusion.kernels.len(), "{name}: nothing was fused");
    }
}

#[test]
fn the_mlp_fuses_bias_relu_and_the_loss_gradient() {
    let module = example("mlp");
    let fusion = fuse(&module, &[]);
    // Forward: matmul + bias + relu is one kernel after the product (the add is inside).
    let h1 = kernel_with(&module, &fusion, "h1");
    assert_eq!(member_ops(&module, h1), ["add", "relu"]);
    // The gradient of softmax cross-entropy: (softmax - one_hot) * scale, one kernel.
    let grad = kernel_with(&module, &fusion, "gradients/loss/softmax_cross_entropy/mul");
    let ops = member_ops(&module, grad);
    assert!(ops.contains(&"one_hot") && ops.contains(&"sub") && ops.contains(&"mul"), "{ops:?}");
    // The ReLU mask and the bias gradient's input: greater + select with the add recomputed.
    let mask = kernel_with(&module, &fusion, "gradients/h1/select");
    assert!(member_ops(&module, mask).contains(&"greater"));
    // Each update reads its gradient, scales it and writes the variable in place.
    let update = kernel_with(&module, &fusion, "h1/w/update/assign_sub");
    assert_eq!(member_ops(&module, update), ["mul", "assign_sub"]);
    // The cross entropy is a row op, stored; the loss is a kernel of its own that averages it.
    let loss = kernel_with(&module, &fusion, "loss");
    assert_eq!(member_ops(&module, loss), ["mean"]);
}

#[test]
fn kept_nodes_stay_stored() {
    let module = example("mlp");
    let add = module.graph.node_ids().find(|&id| module.graph.node(id).name == "h1/add").unwrap();
    let fusion = fuse(&module, &[add]);
    check_well_formed(&module, &fusion, &[add]);
    assert!(fusion.kernel_of(add).is_some());
    let by_op: HashMap<NodeId, &Op> = module.graph.node_ids().map(|id| (id, &module.graph.node(id).op)).collect();
    assert!(matches!(by_op[&add], Op::Binary(_)));
}
