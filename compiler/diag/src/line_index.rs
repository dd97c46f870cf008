/// Maps byte offsets to 1-based line and column numbers (columns count characters).
pub struct LineIndex {
    line_starts: Vec<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LineCol {
    /// 1-based.
    pub line: usize,
    /// 1-based, in characters.
    pub column: usize,
}

impl LineIndex {
    pub fn new(text: &str) -> LineIndex {
        let mut line_starts = vec![0];
        line_starts.extend(text.match_indices('\n').map(|(i, _)| i + 1));
        LineIndex { line_starts }
    }

    pub fn line_col(&self, text: &str, offset: usize) -> LineCol {
        let offset = offset.min(text.len());
        let line = self.line_starts.partition_point(|&start| start <= offset) - 1;
        let start = self.line_starts[line];
        // Offsets inside a multi-byte character count as that character.
        let column = text[start..].char_indices().take_while(|(i, _)| start + i < offset).count();
        LineCol { line: line + 1, column: column + 1 }
    }

    pub fn line_count(&self) -> usize {
        self.line_starts.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_map_to_lines_and_columns() {
        let text = "ab\ncdé\nf";
        let index = LineIndex::new(text);
        assert_eq!(index.line_col(text, 0), LineCol { line: 1, column: 1 });
        assert_eq!(index.line_col(text, 3), LineCol { line: 2, column: 1 });
        assert_eq!(index.line_col(text, 7), LineCol { line: 2, column: 4 });
        assert_eq!(index.line_col(text, 8), LineCol { line: 3, column: 1 });
        assert_eq!(index.line_col(text, 99), LineCol { line: 3, column: 2 });
    }
}
