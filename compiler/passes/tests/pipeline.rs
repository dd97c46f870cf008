//! Pipeline stages (`assign_stages`) on a chain of equal layers: every node is requested on a
//! stage, the stages are consecutive runs of the layers of equal cost, a layer's gradients and
//! update live on its stage, and a variable with its reads.

use dfc_ir::{DeviceSpec, Module, Op};
use dfc_passes::{assign_stages, CostModel};

/// Six equal dense layers, momentum (slots beside each variable).
const CHAIN: &str = "layer dense(x: f32[n, k], units: dim) -> f32[n, units] {
    param w: f32[k, units] = glorot_uniform
    param b: f32[units] = zeros
    return x @ w + b
}

model chain {
    input x: f32[16, 64]
    input y: f32[16, 64]
    let h0 = relu(dense(x, units = 64))
    let h1 = relu(dense(h0, units = 64))
    let h2 = relu(dense(h1, units = 64))
    let h3 = relu(dense(h2, units = 64))
    let h4 = relu(dense(h3, units = 64))
    let h5 = dense(h4, units = 64)
    minimize mean((h5 - y) * (h5 - y)) with momentum(lr = 0.01)
}
";

fn staged(stages: usize) -> (Module, Vec<DeviceSpec>) {
    let (module, diagnostics) = dfc_sema::compile_source(CHAIN, None, &dfc_sema::Options::default());
    let mut module = module.unwrap_or_else(|| panic!("{diagnostics:?}"));
    dfc_passes::run_pipeline(&mut module, None);
    let devices: Vec<DeviceSpec> =
        (0..stages).map(|i| DeviceSpec::parse(&format!("/job:localhost/task:0/cpu:{i}")).unwrap()).collect();
    assign_stages(&mut module, &devices, &CostModel::default());
    (module, devices)
}

/// The stage of the node named `name`.
fn stage_of(module: &Module, devices: &[DeviceSpec], name: &str) -> usize {
    let graph = &module.graph;
    let id = graph.node_ids().find(|&id| graph.node(id).name == name).unwrap_or_else(|| panic!("no `{name}`"));
    let device = graph.node(id).requested_device.as_ref().unwrap_or_else(|| panic!("`{name}` has no stage"));
    devices.iter().position(|d| d == device).expect("one of the stages")
}

#[test]
fn equal_layers_split_evenly_and_their_gradients_and_updates_follow_them() {
    for (stages, expected) in [(2, [0, 0, 0, 1, 1, 1]), (3, [0, 0, 1, 1, 2, 2])] {
        let (module, devices) = staged(stages);
        let graph = &module.graph;
        assert!(graph.node_ids().all(|id| graph.node(id).requested_device.is_some()), "every node has a stage");
        for (layer, &stage) in expected.iter().enumerate() {
            let h = format!("h{layer}");
            let what = format!("{h} of {stages} stages");
            assert_eq!(stage_of(&module, &devices, &format!("{h}/matmul")), stage, "{what}");
            for node in [format!("{h}/w"), format!("{h}/w/read"), format!("{h}/w/momentum")] {
                assert_eq!(stage_of(&module, &devices, &node), stage, "{what}: `{node}`");
            }
            // The weights' gradient, xᵀ·g.
            let gradient = graph
                .node_ids()
                .find(|&id| {
                    let node = graph.node(id);
                    node.name.starts_with(&format!("gradients/{h}/matmul/"))
                        && matches!(node.op, Op::MatMul { transpose_a: true, .. })
                })
                .expect("the weights' gradient");
            assert_eq!(graph.node(gradient).requested_device.as_ref(), Some(&devices[stage]), "{what}: the gradient");
            let update = graph
                .node_ids()
                .find(|&id| {
                    graph.node(id).name.starts_with(&format!("{h}/w/update/"))
                        && matches!(graph.node(id).op, Op::AssignSub)
                })
                .expect("the update");
            assert_eq!(graph.node(update).requested_device.as_ref(), Some(&devices[stage]), "{what}: the update");
        }
    }
}
