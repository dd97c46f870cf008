//! Fuzzes the whole front end, as one iteration of `tests/front_end_fuzz.rs` does: the input
//! (as UTF-8, invalid sequences replaced) is parsed and analysed; the front end must not panic
//! (or overflow its stack), every diagnostic's spans must lie within the source on char
//! boundaries, and every module sema returns must pass `dfc_ir::verify` and print.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let source = String::from_utf8_lossy(data);
    let source: &str = &source;

    let (_file, diagnostics) = dfc_syntax::parse(source);
    let (analyses, more) = dfc_sema::check_source(source, &dfc_sema::Options::default());

    for d in diagnostics.iter().chain(&more) {
        for span in std::iter::once(d.primary.span).chain(d.secondary.iter().map(|l| l.span)) {
            let (start, end) = (span.start as usize, span.end as usize);
            assert!(
                start <= end
                    && end <= source.len()
                    && source.is_char_boundary(start)
                    && source.is_char_boundary(end),
                "span {start}..{end} of diagnostic {:?} `{}` is not a char range of the {}-byte source",
                d.code,
                d.message,
                source.len()
            );
        }
    }

    for analysis in &analyses {
        if let Some(module) = &analysis.module {
            let errors = dfc_ir::verify(module, dfc_ir::VerifyOptions::default());
            assert!(
                errors.is_empty(),
                "the module of model `{}` fails verification: {errors:?}\n{}",
                analysis.model,
                dfc_ir::print(module)
            );
            let _ = dfc_ir::print(module);
        }
    }
});
