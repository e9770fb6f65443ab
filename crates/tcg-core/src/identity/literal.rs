use sha2::{Digest, Sha256};

use crate::{Code, Error, Result};

/// One literal constant: its name, torch dtype text (`torch.float32`), shape
/// and raw little-endian element bytes (SPEC-v1 §3.8).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiteralRow {
    /// The literal's name (its exported fqn).
    pub name: String,
    /// Torch's dtype text, with the `torch.` prefix.
    pub dtype: String,
    /// The shape.
    pub shape: Vec<u64>,
    /// The element bytes of the detached, CPU, contiguous tensor.
    pub bytes: Vec<u8>,
}

/// Python tuple text of a shape: `()`, `(4,)`, `(2, 2)`.
pub fn shape_text(shape: &[u64]) -> String {
    match shape {
        [] => "()".to_string(),
        [one] => format!("({one},)"),
        many => {
            let parts: Vec<String> = many.iter().map(u64::to_string).collect();
            format!("({})", parts.join(", "))
        }
    }
}

/// The streaming literal digest. Rows must be started in ascending name
/// order (code points), each followed by its bytes in one or more `update`s.
#[derive(Debug, Default)]
pub struct LiteralHasher {
    hasher: Sha256,
    rows: usize,
    last_name: Option<String>,
}

impl LiteralHasher {
    /// An empty digest state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Start the next row. Names must strictly increase.
    pub fn begin_row(&mut self, name: &str, dtype: &str, shape: &[u64]) -> Result<()> {
        if let Some(last) = &self.last_name {
            if name <= last.as_str() {
                return Err(Error::new(
                    Code::DeclarationLiteralUnreadable,
                    format!(
                        "literal rows must be unique and in name order: {name:?} after {last:?}"
                    ),
                ));
            }
        }
        self.hasher.update(name.as_bytes());
        self.hasher.update([0u8]);
        self.hasher.update(dtype.as_bytes());
        self.hasher.update(shape_text(shape).as_bytes());
        self.last_name = Some(name.to_string());
        self.rows += 1;
        Ok(())
    }

    /// Feed element bytes of the current row.
    pub fn update(&mut self, bytes: &[u8]) {
        self.hasher.update(bytes);
    }

    /// `""` when no row was given, else the first 32 hex of the digest.
    pub fn finish(self) -> String {
        if self.rows == 0 {
            return String::new();
        }
        let mut h = hex::encode(self.hasher.finalize());
        h.truncate(32);
        h
    }
}

/// The literal digest of `rows`, in any order (they are sorted by name here).
/// Duplicate names are refused (`declaration.literal_unreadable`).
pub fn literal_digest(rows: &[LiteralRow]) -> Result<String> {
    let mut sorted: Vec<&LiteralRow> = rows.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut h = LiteralHasher::new();
    for row in sorted {
        h.begin_row(&row.name, &row.dtype, &row.shape)?;
        h.update(&row.bytes);
    }
    Ok(h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_text_is_python_tuple_text() {
        assert_eq!(shape_text(&[]), "()");
        assert_eq!(shape_text(&[4]), "(4,)");
        assert_eq!(shape_text(&[2, 2]), "(2, 2)");
    }

    #[test]
    fn no_rows_digest_to_the_empty_string() {
        assert_eq!(literal_digest(&[]).unwrap(), "");
    }

    #[test]
    fn duplicate_names_are_refused() {
        let row = LiteralRow {
            name: "t".into(),
            dtype: "torch.int8".into(),
            shape: vec![1],
            bytes: vec![1],
        };
        let err = literal_digest(&[row.clone(), row]).unwrap_err();
        assert_eq!(err.code(), Code::DeclarationLiteralUnreadable);
    }
}
