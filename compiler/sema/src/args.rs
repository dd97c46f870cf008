//! Binding call arguments to parameters, shared by ops, layers, initialisers, optimizers and
//! attributes, so that every callee reports arity and keyword errors the same way.

use dfc_diag::{Code, Diagnostic, Span};
use dfc_syntax::ast::{Arg, Expr};

/// One parameter of a callee: its name and whether it must be given.
#[derive(Clone, Copy, Debug)]
pub struct Param<'n> {
    pub name: &'n str,
    pub required: bool,
}

/// Matches `args` to `params`: positional arguments first, in order, then keywords. Returns
/// the argument for each parameter (`None` where it was left to its default), or `None` after
/// reporting what is wrong.
pub fn bind<'a>(
    callee: &str,
    call_span: Span,
    params: &[Param],
    args: &'a [Arg],
    diagnostics: &mut Vec<Diagnostic>,
) -> Option<Vec<Option<&'a Arg>>> {
    let mut bound: Vec<Option<&Arg>> = vec![None; params.len()];
    let mut ok = true;
    let mut seen_keyword = false;
    let signature = || {
        let names: Vec<String> =
            params.iter().map(|p| if p.required { p.name.to_string() } else { format!("{}=…", p.name) }).collect();
        format!("{callee}({})", names.join(", "))
    };
    let n_positional = args.iter().filter(|a| a.name.is_none()).count();
    for (i, arg) in args.iter().enumerate() {
        match &arg.name {
            None if seen_keyword => {
                diagnostics.push(
                    Diagnostic::error(
                        Code::DUPLICATE_ARGUMENT,
                        arg.span,
                        "positional argument after a keyword argument",
                    )
                    .with_label("give this one by name too")
                    .with_help(format!("the signature is {}", signature())),
                );
                ok = false;
            }
            None if i >= params.len() => {
                if i == params.len() {
                    let plural = if params.len() == 1 { "" } else { "s" };
                    diagnostics.push(
                        Diagnostic::error(
                            Code::ARITY,
                            arg.span,
                            format!("`{callee}` takes {} argument{plural} but {n_positional} were given", params.len()),
                        )
                        .with_label("unexpected argument")
                        .with_help(format!("the signature is {}", signature())),
                    );
                }
                ok = false;
            }
            None => bound[i] = Some(arg),
            Some(name) => {
                seen_keyword = true;
                match params.iter().position(|p| p.name == name.name) {
                    Some(index) if bound[index].is_some() => {
                        diagnostics.push(
                            Diagnostic::error(
                                Code::DUPLICATE_ARGUMENT,
                                name.span,
                                format!("argument `{}` of `{callee}` is given twice", name.name),
                            )
                            .with_secondary(bound[index].expect("checked").span, "first given here"),
                        );
                        ok = false;
                    }
                    Some(index) => bound[index] = Some(arg),
                    None => {
                        let known: Vec<&str> = params.iter().map(|p| p.name).collect();
                        let mut d = Diagnostic::error(
                            Code::UNKNOWN_ARGUMENT,
                            name.span,
                            format!("`{callee}` has no argument named `{}`", name.name),
                        );
                        d = match dfc_diag::closest(&name.name, known.iter().copied()) {
                            Some(best) => {
                                d.with_help(format!("did you mean `{best}`? The signature is {}", signature()))
                            }
                            None => d.with_help(format!("the signature is {}", signature())),
                        };
                        diagnostics.push(d);
                        ok = false;
                    }
                }
            }
        }
    }
    for (param, arg) in params.iter().zip(&bound) {
        if param.required && arg.is_none() && ok {
            diagnostics.push(
                Diagnostic::error(
                    Code::MISSING_ARGUMENT,
                    call_span,
                    format!("`{callee}` is missing its argument `{}`", param.name),
                )
                .with_help(format!("the signature is {}", signature())),
            );
            ok = false;
        }
    }
    ok.then_some(bound)
}

/// The expression of a bound argument.
pub fn expr(arg: Option<&Arg>) -> Option<&Expr> {
    arg.map(|a| &a.value)
}
