//! The canonical JSON of a call's input, which its fingerprint hashes: serde_json's compact
//! encoding with the entries of every map sorted by key.
//!
//! A `HashMap` serializes in its hasher's order, which differs between two maps with the same
//! entries; hashing that would refuse a rebuilt identical input as a reused key. So this
//! serializer writes exactly what `serde_json::to_vec` writes, byte for byte, except that a
//! map's entries (`serialize_map`: `HashMap`, `BTreeMap`, `serde_json::Map`, a struct with
//! `#[serde(flatten)]`) are buffered and written sorted by their key as a string (Rust's
//! `str` order; ties, which only a hand-written `Serialize` can produce, by the value's
//! encoding). Structs keep their field order: it is fixed by the type, and keeping it keeps the
//! fingerprints of inputs without maps what they were before maps were sorted.
//!
//! Every scalar is written by serde_json itself (number formatting, string escaping, non-finite
//! floats as `null`), and a map key by serde_json's own key rules (integers and bools quoted,
//! anything else refused), so the two encodings cannot drift apart on those. Sorting is
//! explicit and does not depend on serde_json's `preserve_order` feature, which some other
//! crate in an application's build may turn on.

use serde::Serialize;
use serde::ser::{self, SerializeMap as _};

/// serde_json's marker struct for a `RawValue` (feature `raw_value`): one field holding JSON
/// text, which serde_json writes verbatim. Its maps are sorted here too.
const RAW_VALUE_TOKEN: &str = "$serde_json::private::RawValue";
/// serde_json's marker struct for a `Number` under `arbitrary_precision`: one field holding
/// the number's digits, which serde_json writes verbatim.
const NUMBER_TOKEN: &str = "$serde_json::private::Number";

/// The canonical JSON of `value` (see the module docs).
pub(crate) fn to_vec<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    let mut out = Vec::with_capacity(128);
    value.serialize(Canonical { out: &mut out })?;
    Ok(out)
}

type Result<T, E = serde_json::Error> = std::result::Result<T, E>;

/// Writes one value into `out`.
struct Canonical<'a> {
    out: &'a mut Vec<u8>,
}

impl<'a> Canonical<'a> {
    /// A scalar, written by serde_json.
    fn scalar<T: Serialize + ?Sized>(self, value: &T) -> Result<()> {
        serde_json::to_writer(&mut *self.out, value)
    }

    /// `{"<variant>":` before a variant's content; [`Compound::end`] closes it.
    fn open_variant(&mut self, variant: &str) -> Result<()> {
        self.out.push(b'{');
        serde_json::to_writer(&mut *self.out, variant)?;
        self.out.push(b':');
        Ok(())
    }

    fn seq(self, closes_variant: bool) -> Compound<'a> {
        self.out.push(b'[');
        Compound {
            out: self.out,
            first: true,
            close: if closes_variant { "]}" } else { "]" },
        }
    }

    fn object(self, closes_variant: bool) -> Compound<'a> {
        self.out.push(b'{');
        Compound {
            out: self.out,
            first: true,
            close: if closes_variant { "}}" } else { "}" },
        }
    }
}

fn nested<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) -> Result<()> {
    value.serialize(Canonical { out })
}

impl<'a> ser::Serializer for Canonical<'a> {
    type Ok = ();
    type Error = serde_json::Error;
    type SerializeSeq = Compound<'a>;
    type SerializeTuple = Compound<'a>;
    type SerializeTupleStruct = Compound<'a>;
    type SerializeTupleVariant = Compound<'a>;
    type SerializeMap = SortedMap<'a>;
    type SerializeStruct = Struct<'a>;
    type SerializeStructVariant = Compound<'a>;

    fn serialize_bool(self, v: bool) -> Result<()> {
        self.scalar(&v)
    }
    fn serialize_i8(self, v: i8) -> Result<()> {
        self.scalar(&v)
    }
    fn serialize_i16(self, v: i16) -> Result<()> {
        self.scalar(&v)
    }
    fn serialize_i32(self, v: i32) -> Result<()> {
        self.scalar(&v)
    }
    fn serialize_i64(self, v: i64) -> Result<()> {
        self.scalar(&v)
    }
    fn serialize_i128(self, v: i128) -> Result<()> {
        self.scalar(&v)
    }
    fn serialize_u8(self, v: u8) -> Result<()> {
        self.scalar(&v)
    }
    fn serialize_u16(self, v: u16) -> Result<()> {
        self.scalar(&v)
    }
    fn serialize_u32(self, v: u32) -> Result<()> {
        self.scalar(&v)
    }
    fn serialize_u64(self, v: u64) -> Result<()> {
        self.scalar(&v)
    }
    fn serialize_u128(self, v: u128) -> Result<()> {
        self.scalar(&v)
    }
    fn serialize_f32(self, v: f32) -> Result<()> {
        self.scalar(&v)
    }
    fn serialize_f64(self, v: f64) -> Result<()> {
        self.scalar(&v)
    }
    fn serialize_char(self, v: char) -> Result<()> {
        self.scalar(&v)
    }
    fn serialize_str(self, v: &str) -> Result<()> {
        self.scalar(v)
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<()> {
        // serde_json writes bytes as an array of numbers; `&[u8]` serializes as a sequence.
        self.scalar(v)
    }
    fn serialize_none(self) -> Result<()> {
        self.scalar(&())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<()> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<()> {
        self.scalar(&())
    }
    fn serialize_unit_struct(self, _name: &'static str) -> Result<()> {
        self.scalar(&())
    }
    fn serialize_unit_variant(self, _: &'static str, _: u32, variant: &'static str) -> Result<()> {
        self.scalar(variant)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<()> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        mut self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<()> {
        self.open_variant(variant)?;
        nested(self.out, value)?;
        self.out.push(b'}');
        Ok(())
    }
    fn serialize_seq(self, _len: Option<usize>) -> Result<Compound<'a>> {
        Ok(self.seq(false))
    }
    fn serialize_tuple(self, _len: usize) -> Result<Compound<'a>> {
        Ok(self.seq(false))
    }
    fn serialize_tuple_struct(self, _: &'static str, _len: usize) -> Result<Compound<'a>> {
        Ok(self.seq(false))
    }
    fn serialize_tuple_variant(
        mut self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Compound<'a>> {
        self.open_variant(variant)?;
        Ok(self.seq(true))
    }
    fn serialize_map(self, _len: Option<usize>) -> Result<SortedMap<'a>> {
        Ok(SortedMap {
            out: self.out,
            entries: Vec::new(),
            key: None,
        })
    }
    fn serialize_struct(self, name: &'static str, _len: usize) -> Result<Struct<'a>> {
        Ok(match name {
            RAW_VALUE_TOKEN => Struct::RawValue(self.out),
            NUMBER_TOKEN => Struct::Number(self.out),
            _ => Struct::Fields(self.object(false)),
        })
    }
    fn serialize_struct_variant(
        mut self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Compound<'a>> {
        self.open_variant(variant)?;
        Ok(self.object(true))
    }
}

/// A sequence, a tuple, or the fields of a struct variant, written as they come.
struct Compound<'a> {
    out: &'a mut Vec<u8>,
    first: bool,
    close: &'static str,
}

impl Compound<'_> {
    fn comma(&mut self) {
        if !std::mem::take(&mut self.first) {
            self.out.push(b',');
        }
    }

    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        self.comma();
        nested(self.out, value)
    }

    fn field<T: Serialize + ?Sized>(&mut self, name: &str, value: &T) -> Result<()> {
        self.comma();
        serde_json::to_writer(&mut *self.out, name)?;
        self.out.push(b':');
        nested(self.out, value)
    }

    fn end(self) -> Result<()> {
        self.out.extend_from_slice(self.close.as_bytes());
        Ok(())
    }
}

impl ser::SerializeSeq for Compound<'_> {
    type Ok = ();
    type Error = serde_json::Error;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        self.element(value)
    }
    fn end(self) -> Result<()> {
        Compound::end(self)
    }
}

impl ser::SerializeTuple for Compound<'_> {
    type Ok = ();
    type Error = serde_json::Error;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        self.element(value)
    }
    fn end(self) -> Result<()> {
        Compound::end(self)
    }
}

impl ser::SerializeTupleStruct for Compound<'_> {
    type Ok = ();
    type Error = serde_json::Error;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        self.element(value)
    }
    fn end(self) -> Result<()> {
        Compound::end(self)
    }
}

impl ser::SerializeTupleVariant for Compound<'_> {
    type Ok = ();
    type Error = serde_json::Error;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        self.element(value)
    }
    fn end(self) -> Result<()> {
        Compound::end(self)
    }
}

impl ser::SerializeStructVariant for Compound<'_> {
    type Ok = ();
    type Error = serde_json::Error;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        value: &T,
    ) -> Result<()> {
        self.field(name, value)
    }
    fn end(self) -> Result<()> {
        Compound::end(self)
    }
}

/// A struct: its fields in declaration order, or one of serde_json's marker structs.
enum Struct<'a> {
    Fields(Compound<'a>),
    RawValue(&'a mut Vec<u8>),
    Number(&'a mut Vec<u8>),
}

impl ser::SerializeStruct for Struct<'_> {
    type Ok = ();
    type Error = serde_json::Error;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        value: &T,
    ) -> Result<()> {
        match self {
            Struct::Fields(fields) => fields.field(name, value),
            Struct::RawValue(out) => {
                // The field is the JSON text; parsed, its maps are sorted like any other.
                let text: String = serde_json::from_value(serde_json::to_value(value)?)?;
                let parsed: serde_json::Value = serde_json::from_str(&text)?;
                nested(out, &parsed)
            }
            Struct::Number(out) => {
                let digits: String = serde_json::from_value(serde_json::to_value(value)?)?;
                out.extend_from_slice(digits.as_bytes());
                Ok(())
            }
        }
    }
    fn end(self) -> Result<()> {
        match self {
            Struct::Fields(fields) => fields.end(),
            Struct::RawValue(_) | Struct::Number(_) => Ok(()),
        }
    }
}

/// A map: entries buffered, written sorted by key on `end`.
struct SortedMap<'a> {
    out: &'a mut Vec<u8>,
    /// (the key as a string, the key's JSON, the value's canonical JSON)
    entries: Vec<(String, Vec<u8>, Vec<u8>)>,
    /// The key of the entry whose value comes next.
    key: Option<(String, Vec<u8>)>,
}

impl ser::SerializeMap for SortedMap<'_> {
    type Ok = ();
    type Error = serde_json::Error;

    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<()> {
        let json = key_json(key)?;
        let text: String = serde_json::from_slice(&json)?;
        self.key = Some((text, json));
        Ok(())
    }

    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        let Some((text, json)) = self.key.take() else {
            return Err(ser::Error::custom("a map value without its key"));
        };
        let mut encoded = Vec::new();
        nested(&mut encoded, value)?;
        self.entries.push((text, json, encoded));
        Ok(())
    }

    fn end(mut self) -> Result<()> {
        self.entries
            .sort_unstable_by(|a, b| (&a.0, &a.2).cmp(&(&b.0, &b.2)));
        self.out.push(b'{');
        for (i, (_, key, value)) in self.entries.iter().enumerate() {
            if i > 0 {
                self.out.push(b',');
            }
            self.out.extend_from_slice(key);
            self.out.push(b':');
            self.out.extend_from_slice(value);
        }
        self.out.push(b'}');
        Ok(())
    }
}

/// The JSON string serde_json writes for `key` as a map key: the one entry of a one-entry map,
/// so serde_json's own rules decide what a key may be and how it is written.
fn key_json<T: Serialize + ?Sized>(key: &T) -> Result<Vec<u8>> {
    struct OneEntry<'k, K: ?Sized>(&'k K);
    impl<K: Serialize + ?Sized> Serialize for OneEntry<'_, K> {
        fn serialize<S: ser::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let mut map = s.serialize_map(Some(1))?;
            map.serialize_entry(self.0, &())?;
            map.end()
        }
    }
    let json = serde_json::to_vec(&OneEntry(key))?;
    json.strip_prefix(b"{")
        .and_then(|rest| rest.strip_suffix(b":null}"))
        .map(<[u8]>::to_vec)
        .ok_or_else(|| ser::Error::custom("serde_json wrote a one-entry map unexpectedly"))
}
