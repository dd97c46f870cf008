//! Learning-rate schedules: the learning rate as a function of the global step (the number of
//! training steps taken before this one), as Keras's `LearningRateSchedule`s define them. The
//! optimizer pass computes it in the graph (`Op::LearningRate`) from the plan's `global_step`
//! variable, so that a run resumed from a checkpoint goes on where it stopped.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The most boundaries of a `piecewise_constant` schedule.
pub const MAX_BOUNDARIES: usize = 1024;

/// A learning rate by step: `decay`, after `warmup_steps` steps of linear warm-up (none for 0).
/// Not recursive, so that decoding a plan cannot recurse without bound.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    pub decay: Decay,
    /// For the first `warmup_steps` steps, `decay`'s first rate scaled by `(step + 1) /
    /// warmup_steps` (a linear ramp that reaches it at step `warmup_steps − 1`); then `decay`
    /// at `step − warmup_steps`.
    pub warmup_steps: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Decay {
    Constant {
        lr: f64,
    },
    /// `initial · rate^(step / decay_steps)`; with `staircase`, the exponent rounded down.
    Exponential {
        initial: f64,
        decay_steps: u64,
        decay_rate: f64,
        staircase: bool,
    },
    /// `values[i]` for `boundaries[i-1] < step ≤ boundaries[i]` (`values[0]` up to and at
    /// the first boundary, the last value past the last): one more value than boundaries.
    Piecewise {
        boundaries: Vec<u64>,
        values: Vec<f64>,
    },
    /// `initial · ((1 − alpha) · ½(1 + cos(π · min(step, decay_steps) / decay_steps)) + alpha)`.
    Cosine {
        initial: f64,
        decay_steps: u64,
        alpha: f64,
    },
}

impl Decay {
    pub fn at(&self, step: u64) -> f64 {
        match self {
            Decay::Constant { lr } => *lr,
            Decay::Exponential { initial, decay_steps, decay_rate, staircase } => {
                let mut p = step as f64 / (*decay_steps).max(1) as f64;
                if *staircase {
                    p = p.floor();
                }
                initial * decay_rate.powf(p)
            }
            Decay::Piecewise { boundaries, values } => {
                let i = boundaries.partition_point(|&b| b < step);
                values.get(i).or(values.last()).copied().unwrap_or(0.0)
            }
            Decay::Cosine { initial, decay_steps, alpha } => {
                let fraction = step.min(*decay_steps) as f64 / (*decay_steps).max(1) as f64;
                let cosine = 0.5 * (1.0 + (std::f64::consts::PI * fraction).cos());
                initial * ((1.0 - alpha) * cosine + alpha)
            }
        }
    }

    fn check(&self) -> Result<(), String> {
        let finite = |what: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(format!("{what} = {v} is not a finite number ≥ 0"))
            }
        };
        let steps = |decay_steps: u64| if decay_steps == 0 { Err("decay_steps = 0".to_string()) } else { Ok(()) };
        match self {
            Decay::Constant { lr } => finite("lr", *lr),
            Decay::Exponential { initial, decay_steps, decay_rate, .. } => {
                finite("initial", *initial)?;
                finite("decay_rate", *decay_rate)?;
                steps(*decay_steps)
            }
            Decay::Piecewise { boundaries, values } => {
                if boundaries.len() > MAX_BOUNDARIES || values.len() != boundaries.len() + 1 {
                    return Err(format!(
                        "{} boundaries and {} values (one more value than boundaries, at most {MAX_BOUNDARIES})",
                        boundaries.len(),
                        values.len()
                    ));
                }
                if boundaries.windows(2).any(|w| w[0] >= w[1]) {
                    return Err("the boundaries do not rise".into());
                }
                values.iter().try_for_each(|&v| finite("a value", v))
            }
            Decay::Cosine { initial, decay_steps, alpha } => {
                finite("initial", *initial)?;
                finite("alpha", *alpha)?;
                steps(*decay_steps)
            }
        }
    }
}

impl LrSchedule {
    /// The learning rate at `step`.
    pub fn at(&self, step: u64) -> f64 {
        let warmup = self.warmup_steps;
        if step < warmup {
            self.decay.at(0) * (step + 1) as f64 / warmup as f64
        } else {
            self.decay.at(step - warmup)
        }
    }

    /// Why the schedule is not one (a plan is data: a damaged one must be refused, not
    /// divided by zero).
    pub fn check(&self) -> Result<(), String> {
        self.decay.check()
    }
}

impl fmt::Display for Decay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decay::Constant { lr } => write!(f, "{lr:?}"),
            Decay::Exponential { initial, decay_steps, decay_rate, staircase } => {
                write!(f, "exponential_decay({initial:?}, decay_steps={decay_steps}, decay_rate={decay_rate:?}")?;
                if *staircase {
                    f.write_str(", staircase=true")?;
                }
                f.write_str(")")
            }
            Decay::Piecewise { boundaries, values } => {
                write!(f, "piecewise_constant(boundaries={boundaries:?}, values={values:?})")
            }
            Decay::Cosine { initial, decay_steps, alpha } => {
                write!(f, "cosine_decay({initial:?}, decay_steps={decay_steps}, alpha={alpha:?})")
            }
        }
    }
}

impl fmt::Display for LrSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.warmup_steps {
            0 => write!(f, "{}", self.decay),
            steps => write!(f, "warmup({}, steps={steps})", self.decay),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(decay: Decay) -> LrSchedule {
        LrSchedule { decay, warmup_steps: 0 }
    }

    #[test]
    fn schedules_give_keras_rates() {
        let exp = plain(Decay::Exponential { initial: 0.1, decay_steps: 10, decay_rate: 0.5, staircase: false });
        assert_eq!(exp.at(0), 0.1);
        assert!((exp.at(10) - 0.05).abs() < 1e-15);
        assert!((exp.at(5) - 0.1 * 0.5f64.sqrt()).abs() < 1e-15);
        let stairs = plain(Decay::Exponential { initial: 0.1, decay_steps: 10, decay_rate: 0.5, staircase: true });
        assert_eq!(stairs.at(19), 0.05);
        let piecewise = plain(Decay::Piecewise { boundaries: vec![10, 20], values: vec![1.0, 0.5, 0.1] });
        assert_eq!([0, 10, 11, 20, 21, 1000].map(|s| piecewise.at(s)), [1.0, 1.0, 0.5, 0.5, 0.1, 0.1]);
        let cosine = Decay::Cosine { initial: 1.0, decay_steps: 100, alpha: 0.1 };
        let plain_cosine = plain(cosine.clone());
        assert_eq!(plain_cosine.at(0), 1.0);
        assert!((plain_cosine.at(50) - 0.55).abs() < 1e-12);
        assert!((plain_cosine.at(100) - 0.1).abs() < 1e-12);
        assert!((plain_cosine.at(500) - 0.1).abs() < 1e-12);
        let warm = LrSchedule { decay: cosine, warmup_steps: 4 };
        assert_eq!([0, 1, 3].map(|s| warm.at(s)), [0.25, 0.5, 1.0]);
        assert!((warm.at(54) - 0.55).abs() < 1e-12);
        assert_eq!(warm.to_string(), "warmup(cosine_decay(1.0, decay_steps=100, alpha=0.1), steps=4)");
    }

    #[test]
    fn damaged_schedules_are_refused() {
        let zero = plain(Decay::Cosine { initial: 1.0, decay_steps: 0, alpha: 0.0 });
        assert!(zero.check().is_err());
        let nan = plain(Decay::Exponential { initial: f64::NAN, decay_steps: 1, decay_rate: 0.5, staircase: false });
        assert!(nan.check().is_err());
        let short = plain(Decay::Piecewise { boundaries: vec![1, 2], values: vec![1.0] });
        assert!(short.check().is_err());
        let falling = plain(Decay::Piecewise { boundaries: vec![2, 1], values: vec![1.0, 1.0, 1.0] });
        assert!(falling.check().is_err());
        assert!(plain(Decay::Constant { lr: -1.0 }).check().is_err());
    }
}
