//! Python objects <-> CJ values (SPEC-v1 §2.1).

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use tcg_cj::{CjError, CjErrorCode, Map, Value};

/// Convert a Python value to the CJ model: None, bool, int (i64), float, str,
/// list, tuple (as an array) and dict with str keys. Anything else, non-str
/// keys and lone surrogates are `cj.invalid_value`; ints beyond i64 are
/// `cj.integer_range`. `path` names the value in messages.
pub fn to_value(obj: &Bound<'_, PyAny>, path: &str) -> Result<Value, CjError> {
    if obj.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        return obj.extract::<i64>().map(Value::Int).map_err(|_| {
            CjError::new(
                CjErrorCode::IntegerRange,
                path,
                "integer is outside the signed 64-bit range -9223372036854775808..9223372036854775807",
            )
        });
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(Value::Float(f.value()));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return s.to_str().map(|s| Value::Str(s.to_owned())).map_err(|_| {
            CjError::new(
                CjErrorCode::InvalidValue,
                path,
                "string is not valid unicode (lone surrogate)",
            )
        });
    }
    if let Ok(list) = obj.cast::<PyList>() {
        return list
            .iter()
            .enumerate()
            .map(|(i, item)| to_value(&item, &format!("{path}[{i}]")))
            .collect::<Result<_, _>>()
            .map(Value::Array);
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return tuple
            .iter()
            .enumerate()
            .map(|(i, item)| to_value(&item, &format!("{path}[{i}]")))
            .collect::<Result<_, _>>()
            .map(Value::Array);
    }
    if let Ok(dict) = obj.cast::<PyDict>() {
        let mut map = Map::new();
        for (k, v) in dict.iter() {
            let key = match k.cast::<PyString>() {
                Ok(s) => s.to_str().map_err(|_| {
                    CjError::new(
                        CjErrorCode::InvalidValue,
                        path,
                        "object key is not valid unicode",
                    )
                })?,
                Err(_) => {
                    return Err(CjError::new(
                        CjErrorCode::InvalidValue,
                        path,
                        format!("object keys must be str, got {}", type_name(&k)),
                    ))
                }
            };
            let child = to_value(&v, &format!("{path}[{key:?}]"))?;
            map.insert(key.to_owned(), child);
        }
        return Ok(Value::Object(map));
    }
    Err(CjError::new(
        CjErrorCode::InvalidValue,
        path,
        format!("{} is not a json value", type_name(obj)),
    ))
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".into())
}

/// Convert a CJ value to plain Python objects.
pub fn from_value<'py>(py: Python<'py>, value: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Int(i) => i.into_pyobject(py)?.into_any(),
        Value::Float(f) => PyFloat::new(py, *f).into_any(),
        Value::Str(s) => PyString::new(py, s).into_any(),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(from_value(py, item)?)?;
            }
            list.into_any()
        }
        Value::Object(map) => {
            let dict = PyDict::new(py);
            for (k, v) in map {
                dict.set_item(k, from_value(py, v)?)?;
            }
            dict.into_any()
        }
    })
}
