//! The reward-model fixture (fixtures/make_rm_hvp_fixture.py): the tiny Llama of `features`'
//! fixtures as r = θᵀh_ψ, its pairs, and PyTorch's float64 loss, gradients and exact
//! (double-backward) Hessian–vector products at the fixture's parameters.

use candle_core::{DType, Device, Tensor};
use features::model::{Config, HfConfig};
use policy::rm::model::{RewardModel, RmPair};
use policy::{LoraConfig, PolicyModel, Target};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/rm-hvp")
}

/// The tiny Llama (LoRA r 2 on every linear layer, or every weight trainable) on `dev`.
pub fn tiny_llama_on(dtype: DType, full: bool, dev: &Device) -> PolicyModel {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../features/tests/fixtures/tiny-llama");
    let hf: HfConfig = serde_json::from_str(&std::fs::read_to_string(base.join("config.json")).unwrap()).unwrap();
    let cfg = Config::from_hf(&hf).unwrap();
    let t: HashMap<String, Tensor> = candle_core::safetensors::load(base.join("model.safetensors"), dev).unwrap();
    if full {
        return PolicyModel::new_full(t, cfg, 32, dtype).unwrap();
    }
    let lora = LoraConfig { rank: 2, alpha: 4.0, targets: Target::ALL.to_vec(), seed: 0, dropout: 0.0 };
    PolicyModel::new(t, cfg, &lora, 32, dtype).unwrap()
}

pub fn tiny_llama(dtype: DType, full: bool) -> PolicyModel {
    tiny_llama_on(dtype, full, &Device::Cpu)
}

pub struct Fixture {
    pub pairs: Vec<(Vec<u32>, Vec<u32>, f32)>,
    pub loss: f64,
    pub t: HashMap<String, Tensor>,
}

/// The fixture of `case` ("lora" or "full").
pub fn fixture(case: &str) -> Fixture {
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("pairs.json")).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    };
    let pairs = j["pairs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (ids(&p["a"]), ids(&p["b"]), p["y"].as_f64().unwrap() as f32))
        .collect();
    let t = candle_core::safetensors::load(fixtures().join(format!("{case}.safetensors")), &Device::Cpu).unwrap();
    Fixture { pairs, loss: j["loss"][case].as_f64().unwrap(), t }
}

impl Fixture {
    pub fn pairs(&self) -> Vec<RmPair<'_>> {
        self.pairs.iter().map(|(a, b, y)| RmPair { a, b, y: *y }).collect()
    }

    /// The tensors `prefix/<name>` for `names`, in `dtype`, on the CPU.
    pub fn get(&self, prefix: &str, names: &[String], dtype: DType) -> Vec<Tensor> {
        names
            .iter()
            .map(|n| {
                self.t.get(&format!("{prefix}/{n}")).unwrap_or_else(|| panic!("{prefix}/{n}")).to_dtype(dtype).unwrap()
            })
            .collect()
    }
}

/// The fixture's reward model in `dtype` on `dev`: its parameter values set from the fixture
/// (a full model's weights are the tiny Llama's own; the fixture holds its θ).
pub fn fixture_model_on(fx: &Fixture, full: bool, dtype: DType, dev: &Device) -> RewardModel {
    let rm = RewardModel::new(tiny_llama_on(dtype, full, dev), &[0.0; 32], true).unwrap();
    for (v, name) in rm.vars().iter().zip(rm.var_names()) {
        if let Some(x) = fx.t.get(&format!("param/{name}")) {
            v.set(&x.to_dtype(dtype).unwrap().reshape(v.as_tensor().shape()).unwrap().to_device(dev).unwrap()).unwrap();
        }
    }
    rm
}

pub fn fixture_model(fx: &Fixture, full: bool, dtype: DType) -> RewardModel {
    fixture_model_on(fx, full, dtype, &Device::Cpu)
}

/// Every tensor flattened, concatenated and widened to f64 (on the CPU).
pub fn flat64(ts: &[Tensor]) -> Vec<f64> {
    ts.iter().flat_map(|t| t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()).collect()
}

/// ‖a − b‖ / ‖b‖.
pub fn rel_l2(a: &[f64], b: &[f64]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum::<f64>().sqrt();
    d / b.iter().map(|y| y * y).sum::<f64>().sqrt()
}
