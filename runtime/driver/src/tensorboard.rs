//! `dfc run --tensorboard DIR`: each epoch's metrics as TensorBoard scalars. A run writes one
//! event file, `DIR/events.out.tfevents.<seconds>.<host>.dfc`, which TensorBoard reads with the
//! other files of the directory (a resumed run's included):
//!
//! - TFRecord framing: each record is its length (u64, little-endian), the masked CRC-32C of
//!   those 8 bytes, the bytes, and their masked CRC-32C;
//! - each record a `tensorflow.Event` protobuf (TensorFlow's event.proto, the fields used
//!   here): first the `file_version` `brain.Event:2`, then per epoch one event at the global
//!   step whose summary holds a `simple_value` per metric, tagged as in `metrics.jsonl`.

use prost::Message;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

/// `tensorflow.Event`: of its `what`, the file version and a summary.
#[derive(Clone, PartialEq, Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value`: a tag and a scalar.
#[derive(Clone, PartialEq, Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// An event file being written.
pub struct EventWriter {
    file: BufWriter<File>,
}

impl EventWriter {
    /// A new event file in `dir` (made if missing), its version record written.
    pub fn create(dir: &Path) -> io::Result<EventWriter> {
        std::fs::create_dir_all(dir)?;
        let seconds = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let host = hostname();
        // A name no other run of this second on this host takes: the process id.
        let path = dir.join(format!("events.out.tfevents.{seconds}.{host}.{}.dfc", std::process::id()));
        let mut writer = EventWriter { file: BufWriter::new(File::create(&path)?) };
        let version = Event { wall_time: wall_time(), file_version: Some("brain.Event:2".into()), ..Event::default() };
        writer.write(&version)?;
        Ok(writer)
    }

    /// One event at `step` with a scalar per `(tag, value)`; non-finite values as they are
    /// (TensorBoard shows NaN). Flushed, so that TensorBoard sees each epoch as it ends.
    pub fn scalars(&mut self, step: u64, values: &[(String, f64)]) -> io::Result<()> {
        let value = values
            .iter()
            .map(|(tag, value)| SummaryValue { tag: tag.clone(), simple_value: Some(*value as f32) })
            .collect();
        let event = Event {
            wall_time: wall_time(),
            step: step.min(i64::MAX as u64) as i64,
            summary: Some(Summary { value }),
            ..Event::default()
        };
        self.write(&event)
    }

    fn write(&mut self, event: &Event) -> io::Result<()> {
        let data = event.encode_to_vec();
        let length = (data.len() as u64).to_le_bytes();
        self.file.write_all(&length)?;
        self.file.write_all(&masked_crc(&length).to_le_bytes())?;
        self.file.write_all(&data)?;
        self.file.write_all(&masked_crc(&data).to_le_bytes())?;
        self.file.flush()
    }
}

/// TFRecord's masked CRC-32C.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn wall_time() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// This machine's name for the file name (letters, digits, `-` and `.` only), else `localhost`.
fn hostname() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let name: String = name.trim().chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '.').collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TFRecord's framing of the 8 bytes `[0; 8]` masks CRC-32C 0x8c28b28a: the mask is a
    /// rotation right by 15 plus 0xa282ead8, as TensorFlow's `crc32c::Mask`.
    #[test]
    fn the_crc_is_masked_as_tensorflow_masks_it() {
        let crc = crc32c::crc32c(&[0u8; 8]);
        assert_eq!(masked_crc(&[0u8; 8]), ((crc >> 15) | (crc << 17)).wrapping_add(0xa282_ead8));
        // CRC-32C's check value ("123456789"), so that the crate is the Castagnoli CRC.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
    }
}
