//! An optimizer's `lr`: a number, or a learning-rate schedule (`exponential_decay`,
//! `piecewise_constant`, `cosine_decay`, and `warmup` of a number or one of those), checked
//! here with diagnostics at the offending argument.

use crate::args::{self, Param};
use crate::lower::Lowerer;
use dfc_diag::{Code, Diagnostic};
use dfc_ir::{Decay, LrSchedule, MAX_BOUNDARIES};
use dfc_syntax::ast::{Call, Expr, ExprKind};

/// Every learning-rate schedule an optimizer's `lr` takes: name, signature with defaults, one
/// line of documentation.
pub const SCHEDULES: &[(&str, &str, &str)] = &[
    (
        "exponential_decay",
        "exponential_decay(initial, decay_steps, decay_rate, staircase=false)",
        "Learning rate initial · decay_rate^(step / decay_steps) (the exponent rounded down with staircase).",
    ),
    (
        "piecewise_constant",
        "piecewise_constant(boundaries, values)",
        "Learning rate values[i] between boundaries[i-1] (exclusive) and boundaries[i] (inclusive): one more value than boundaries.",
    ),
    (
        "cosine_decay",
        "cosine_decay(initial, decay_steps, alpha=0)",
        "Learning rate falling from initial along a half cosine to initial · alpha at decay_steps, then staying.",
    ),
    (
        "warmup",
        "warmup(lr, steps)",
        "A linear ramp to `lr` (a number or a schedule) over the first `steps` steps, then `lr`.",
    ),
];

pub fn is_schedule(name: &str) -> bool {
    SCHEDULES.iter().any(|(n, _, _)| *n == name)
}

impl Lowerer<'_> {
    /// `lr` as a schedule: `None` for a plain number (or after an error, reported), else the
    /// schedule. `Err(())` marks an error.
    pub(crate) fn lr_schedule(&mut self, expr: &Expr) -> Result<Option<LrSchedule>, ()> {
        let ExprKind::Call(call) = &expr.kind else { return Ok(None) };
        let name = call.callee.name.as_str();
        if !is_schedule(name) {
            let names: Vec<&str> = SCHEDULES.iter().map(|(n, _, _)| *n).collect();
            let mut d = Diagnostic::error(
                Code::BAD_OPTIMIZER,
                call.callee.span,
                format!("`{name}` is not a learning-rate schedule"),
            );
            d = match dfc_diag::closest(name, names.iter().copied()) {
                Some(best) => d.with_help(format!("did you mean `{best}`?")),
                None => d.with_help(format!("`lr` is a number or one of {}", dfc_diag::one_of(&names))),
            };
            self.diagnostics.push(d);
            return Err(());
        }
        if name == "warmup" {
            let params = [Param { name: "lr", required: true }, Param { name: "steps", required: true }];
            let bound = args::bind(name, call.span, &params, &call.args, &mut self.diagnostics).ok_or(())?;
            let inner = args::expr(bound[0]).ok_or(())?;
            if let ExprKind::Call(c) = &inner.kind {
                if c.callee.name == "warmup" {
                    self.diagnostics.push(
                        Diagnostic::error(Code::BAD_OPTIMIZER, inner.span, "a warm-up of a warm-up")
                            .with_help("give one `warmup` the whole ramp"),
                    );
                    return Err(());
                }
            }
            let steps = self.steps(args::expr(bound[1]).ok_or(())?, "`steps`")?;
            let decay = match self.lr_schedule(inner)? {
                Some(schedule) => schedule.decay,
                None => Decay::Constant { lr: self.rate(inner, "`lr`")? },
            };
            return Ok(Some(LrSchedule { decay, warmup_steps: steps }));
        }
        let decay = self.decay(name, call)?;
        Ok(Some(LrSchedule { decay, warmup_steps: 0 }))
    }

    fn decay(&mut self, name: &str, call: &Call) -> Result<Decay, ()> {
        let params: &[Param] = match name {
            "exponential_decay" => &[
                Param { name: "initial", required: true },
                Param { name: "decay_steps", required: true },
                Param { name: "decay_rate", required: true },
                Param { name: "staircase", required: false },
            ],
            "piecewise_constant" => {
                &[Param { name: "boundaries", required: true }, Param { name: "values", required: true }]
            }
            _ => &[
                Param { name: "initial", required: true },
                Param { name: "decay_steps", required: true },
                Param { name: "alpha", required: false },
            ],
        };
        let bound = args::bind(name, call.span, params, &call.args, &mut self.diagnostics).ok_or(())?;
        let arg = |i: usize| args::expr(bound[i]);
        match name {
            "exponential_decay" => {
                let initial = self.rate(arg(0).ok_or(())?, "`initial`")?;
                let decay_steps = self.steps(arg(1).ok_or(())?, "`decay_steps`")?;
                let decay_rate = self.rate(arg(2).ok_or(())?, "`decay_rate`")?;
                let staircase = match arg(3) {
                    Some(e) => self.const_bool(e, "`staircase`").ok_or(())?,
                    None => false,
                };
                Ok(Decay::Exponential { initial, decay_steps, decay_rate, staircase })
            }
            "piecewise_constant" => {
                let (boundaries_expr, values_expr) = (arg(0).ok_or(())?, arg(1).ok_or(())?);
                let boundaries = self.const_int_list(boundaries_expr, "`boundaries`").ok_or(())?;
                let values = self.rate_list(values_expr)?;
                let rising = boundaries.windows(2).all(|w| w[0] < w[1]);
                if boundaries.iter().any(|&b| b < 0) || !rising || boundaries.len() > MAX_BOUNDARIES {
                    self.diagnostics.push(
                        Diagnostic::error(Code::BAD_OPTIMIZER, boundaries_expr.span, "the boundaries must rise")
                            .with_label(format!("steps ≥ 0, each above the one before, at most {MAX_BOUNDARIES}")),
                    );
                    return Err(());
                }
                if values.len() != boundaries.len() + 1 {
                    self.diagnostics.push(
                        Diagnostic::error(
                            Code::BAD_OPTIMIZER,
                            values_expr.span,
                            format!("{} values for {} boundaries", values.len(), boundaries.len()),
                        )
                        .with_label(format!("needs {}: one more value than boundaries", boundaries.len() + 1)),
                    );
                    return Err(());
                }
                Ok(Decay::Piecewise { boundaries: boundaries.into_iter().map(|b| b as u64).collect(), values })
            }
            _ => {
                let initial = self.rate(arg(0).ok_or(())?, "`initial`")?;
                let decay_steps = self.steps(arg(1).ok_or(())?, "`decay_steps`")?;
                let alpha = match arg(2) {
                    Some(e) => self.rate(e, "`alpha`")?,
                    None => 0.0,
                };
                Ok(Decay::Cosine { initial, decay_steps, alpha })
            }
        }
    }

    /// A rate: a finite number ≥ 0.
    fn rate(&mut self, expr: &Expr, what: &str) -> Result<f64, ()> {
        let v = self.const_f64(expr, what).ok_or(())?;
        if v.is_finite() && v >= 0.0 {
            return Ok(v);
        }
        self.diagnostics.push(
            Diagnostic::error(Code::BAD_OPTIMIZER, expr.span, format!("{what} = {v} is out of range"))
                .with_label("must be a finite number ≥ 0"),
        );
        Err(())
    }

    /// A count of steps: an integer ≥ 1.
    fn steps(&mut self, expr: &Expr, what: &str) -> Result<u64, ()> {
        let v = self.const_int(expr, what).ok_or(())?;
        if v >= 1 {
            return Ok(v as u64);
        }
        self.diagnostics.push(
            Diagnostic::error(Code::BAD_OPTIMIZER, expr.span, format!("{what} = {v} is out of range"))
                .with_label("must be a whole number of steps ≥ 1"),
        );
        Err(())
    }

    /// A literal list of rates.
    fn rate_list(&mut self, expr: &Expr) -> Result<Vec<f64>, ()> {
        let ExprKind::Array(items) = &expr.kind else {
            self.diagnostics.push(
                Diagnostic::error(Code::ARGUMENT_KIND, expr.span, "`values` must be a list of numbers")
                    .with_label("not a list"),
            );
            return Err(());
        };
        items.iter().map(|e| self.rate(e, "a value")).collect()
    }
}
