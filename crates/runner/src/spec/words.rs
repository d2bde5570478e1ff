//! The words a number may be given as (`"none"`, `"auto"`, `"theory"`: one macro), a swept
//! key ([`Sweep`]), and the data's scale that λ = "auto" resolves from ([`DataScale`]).

use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
use serde::{de, Deserialize, Deserializer, Serialize, Serializer};
use std::borrow::Cow;
use std::fmt;

/// One value or an array of values to sweep over.
#[derive(Clone, Debug, PartialEq)]
pub struct Sweep<T>(pub Vec<T>);

impl<T> Sweep<T> {
    pub fn one(v: T) -> Self {
        Sweep(vec![v])
    }
}

impl<T: Serialize> Serialize for Sweep<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0.len() == 1 {
            self.0[0].serialize(s)
        } else {
            self.0.serialize(s)
        }
    }
}

/// The key reference shows a swept key as its value's type, marked sweepable (`x-sweep`).
impl<T: JsonSchema> JsonSchema for Sweep<T> {
    fn schema_name() -> Cow<'static, str> {
        format!("Sweep_{}", T::schema_name()).into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(g: &mut SchemaGenerator) -> Schema {
        let one = g.subschema_for::<T>();
        json_schema!({ "anyOf": [one, { "type": "array", "items": one }], "x-sweep": true })
    }
}

/// A swept value as the user wrote it (`rloo`, `0.1`).
fn written<T: Serialize>(x: &T) -> String {
    match toml::Value::try_from(x) {
        Ok(toml::Value::String(s)) => s,
        Ok(v) => v.to_string(),
        Err(_) => "a value".into(),
    }
}

impl<'de, T: Deserialize<'de> + PartialEq + Serialize> Deserialize<'de> for Sweep<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        macro_rules! scalar {
            ($name:ident, $ty:ty, $de:ident) => {
                fn $name<E: de::Error>(self, v: $ty) -> Result<Self::Value, E> {
                    T::deserialize(de::value::$de::<E>::new(v)).map(|x| Sweep(vec![x]))
                }
            };
        }
        impl<'de, T: Deserialize<'de> + PartialEq + Serialize> de::Visitor<'de> for V<T> {
            type Value = Sweep<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a value or a non-empty array of values to sweep over")
            }
            scalar!(visit_bool, bool, BoolDeserializer);
            scalar!(visit_i64, i64, I64Deserializer);
            scalar!(visit_u64, u64, U64Deserializer);
            scalar!(visit_f64, f64, F64Deserializer);
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                T::deserialize(de::value::StrDeserializer::<E>::new(v)).map(|x| Sweep(vec![x]))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(x) = seq.next_element::<T>()? {
                    // a value twice would be the same cells twice
                    if let Some(i) = out.iter().position(|y| *y == x) {
                        return Err(de::Error::custom(format!(
                            "`{}` is listed twice (entries {} and {}): each value of a list is swept once",
                            written(&x),
                            i + 1,
                            out.len() + 1
                        )));
                    }
                    out.push(x);
                }
                if out.is_empty() {
                    return Err(de::Error::custom("an empty array sweeps over nothing: give at least one value"));
                }
                Ok(Sweep(out))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// A hyper-parameter that is a number or one word: the enum `$name` with the word's variant
/// and `Value(f64)`, written back as the number or the word, read from either (integers too);
/// anything else is "`x`: expected a number or "word"".
macro_rules! number_or_word {
    ($(#[$doc:meta])* $name:ident, $word:ident, $text:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub enum $name {
            $word,
            Value(f64),
        }

        impl JsonSchema for $name {
            fn schema_name() -> Cow<'static, str> {
                stringify!($name).into()
            }
            fn inline_schema() -> bool {
                true
            }
            fn json_schema(_: &mut SchemaGenerator) -> Schema {
                json_schema!({ "anyOf": [{ "type": "number" }, { "const": $text }] })
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                match self {
                    $name::$word => s.serialize_str($text),
                    $name::Value(v) => s.serialize_f64(*v),
                }
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl de::Visitor<'_> for V {
                    type Value = $name;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        write!(f, "a number or \"{}\"", $text)
                    }
                    fn visit_f64<E: de::Error>(self, v: f64) -> Result<$name, E> {
                        Ok($name::Value(v))
                    }
                    fn visit_i64<E: de::Error>(self, v: i64) -> Result<$name, E> {
                        Ok($name::Value(v as f64))
                    }
                    fn visit_u64<E: de::Error>(self, v: u64) -> Result<$name, E> {
                        Ok($name::Value(v as f64))
                    }
                    fn visit_str<E: de::Error>(self, v: &str) -> Result<$name, E> {
                        if v == $text {
                            Ok($name::$word)
                        } else {
                            Err(E::custom(format!("`{v}`: expected a number or \"{}\"", $text)))
                        }
                    }
                }
                d.deserialize_any(V)
            }
        }
    };
}

number_or_word!(
    /// A number, or the word "none" (no clipping, no projection).
    OrNone,
    None,
    "none"
);

impl OrNone {
    pub fn get(&self) -> Option<f64> {
        match self {
            OrNone::None => None,
            OrNone::Value(v) => Some(*v),
        }
    }
}

impl From<Option<f64>> for OrNone {
    fn from(v: Option<f64>) -> Self {
        v.map_or(OrNone::None, OrNone::Value)
    }
}

number_or_word!(
    /// A number, or the word "auto": resolved from the data once it is read (λ = "auto": the
    /// median ‖z‖² of the first pairs, [`DataScale`]).
    OrAuto,
    Auto,
    "auto"
);

impl OrAuto {
    /// The number, with "auto" resolved to `auto`.
    pub fn or(&self, auto: f64) -> f64 {
        match self {
            OrAuto::Auto => auto,
            OrAuto::Value(v) => *v,
        }
    }
}

number_or_word!(
    /// A confidence width β: a number, or "theory" (√d·log(T/δ), the order of Lemma 1).
    Beta,
    Theory,
    "theory"
);

/// The scale of the data's differences z = φ(x, a) − φ(x, a′): ‖z‖² over the first
/// [`DataScale::PAIRS`] training pairs in file order (bandits: arms 0 and 1 of the first
/// contexts). λ = "auto" is the median; meta.json and the report show it beside each λ.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DataScale {
    pub pairs: usize,
    pub median_z_sq: f64,
    pub p90_z_sq: f64,
    pub max_z_sq: f64,
}

impl DataScale {
    pub const PAIRS: usize = 1000;

    /// The scale of `zs` (row-major, `d` per row), the first [`DataScale::PAIRS`] rows.
    pub fn of(zs: &[f32], d: usize) -> DataScale {
        let mut sq: Vec<f64> = zs
            .chunks_exact(d.max(1))
            .take(Self::PAIRS)
            .map(|z| z.iter().map(|&v| f64::from(v) * f64::from(v)).sum())
            .collect();
        if sq.is_empty() {
            return DataScale::default();
        }
        sq.sort_by(f64::total_cmp);
        let at = |q: f64| sq[((sq.len() - 1) as f64 * q).round() as usize];
        DataScale { pairs: sq.len(), median_z_sq: at(0.5), p90_z_sq: at(0.9), max_z_sq: sq[sq.len() - 1] }
    }

    /// What λ = "auto" resolves to: the median ‖z‖² (so a typical pair moves the margin by
    /// about one unit in a full 𝓗⁻¹z step), 1 when the data has no nonzero difference.
    pub fn auto_lambda(&self) -> f64 {
        if self.median_z_sq > 0.0 && self.median_z_sq.is_finite() {
            self.median_z_sq
        } else {
            1.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize, Serialize, JsonSchema)]
    struct T {
        clip: OrNone,
        lambda: OrAuto,
        beta: Beta,
    }

    /// The words and the numbers read and write back; another word or type is refused naming
    /// what was expected.
    #[test]
    fn a_number_or_its_word() {
        let t: T = toml::from_str("clip = \"none\"\nlambda = 2\nbeta = 0.5").unwrap();
        assert_eq!((t.clip, t.lambda, t.beta), (OrNone::None, OrAuto::Value(2.0), Beta::Value(0.5)));
        let t: T = toml::from_str("clip = 1.5\nlambda = \"auto\"\nbeta = \"theory\"").unwrap();
        assert_eq!((t.clip, t.lambda, t.beta), (OrNone::Value(1.5), OrAuto::Auto, Beta::Theory));
        let back: T = toml::from_str(&toml::to_string(&t).unwrap()).unwrap();
        assert_eq!((back.clip, back.lambda, back.beta), (t.clip, t.lambda, t.beta));
        for (text, says) in [
            ("clip = \"auto\"\nlambda = 1\nbeta = 1", "`auto`: expected a number or \"none\""),
            ("clip = 1\nlambda = \"none\"\nbeta = 1", "`none`: expected a number or \"auto\""),
            ("clip = 1\nlambda = 1\nbeta = true", "expected a number or \"theory\""),
        ] {
            let e = toml::from_str::<T>(text).unwrap_err().to_string();
            assert!(e.contains(says), "{text}: {e}");
        }
    }
}
