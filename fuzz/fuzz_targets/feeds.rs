//! Fuzzes every data reader `dfc run` opens: the first byte of the input picks the reader (and
//! so the file name whose extension selects a format), the rest are the file's bytes. Every
//! reader must return a tensor or an error with a one-line message — never panic, overflow its
//! stack or allocate more than the input justifies (libFuzzer's -rss_limit_mb catches that).

#![no_main]

use dfc_ir::DType;
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Some((&which, bytes)) = data.split_first() else { return };
    let message = match which % 9 {
        0 => dfc_driver::data::load_bytes(Path::new("train-images-idx3-ubyte"), bytes).err().map(|e| e.to_string()),
        1 => dfc_driver::data::load_bytes(Path::new("train-labels-idx1-ubyte.gz"), bytes).err().map(|e| e.to_string()),
        2 => dfc_driver::data::load_bytes(Path::new("x.npy"), bytes).err().map(|e| e.to_string()),
        3 => dfc_driver::data::load_bytes(Path::new("x.csv"), bytes).err().map(|e| e.to_string()),
        4 => dfc_driver::data::parse_idx(Path::new("x-idx1-ubyte"), bytes).err().map(|e| e.to_string()),
        5 => dfc_driver::npy::parse(Path::new("x.npy"), bytes).err().map(|e| e.to_string()),
        6 => {
            let dtype = [DType::F32, DType::F64, DType::I32, DType::I64, DType::U8, DType::Bool][bytes.len() % 6];
            dfc_driver::data::parse_csv(Path::new("x.tsv"), bytes, dtype).err().map(|e| e.to_string())
        }
        7 => dfc_driver::checkpoint::parse(Path::new("ckpt-00000001.safetensors"), bytes).err().map(|e| e.to_string()),
        _ => {
            // A text feed (`text:PATH`), windows as long as the next byte says.
            let window = bytes.first().map_or(0, |&b| usize::from(b));
            dfc_driver::data::text_windows_of_bytes(Path::new("corpus.txt"), bytes, window).err().map(|e| e.to_string())
        }
    };
    if let Some(message) = message {
        assert!(!message.contains('\n'), "a message of several lines: {message:?}");
    }
});
