//! The passes over the IR: autodiff, optimizer updates, prune, simplify.
