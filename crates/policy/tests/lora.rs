//! LoRA on a tiny random decoder: the differentiable path gives the inference path's logits
//! (`features::model::Model`, itself checked against transformers), adapters on the side give
//! the logits of the merged weights, and backpropagation gives the gradients of central
//! differences (in f64).

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use features::model::Family;
use policy::loss::{masked_sum, token_logprobs};
use policy::{LoraConfig, PolicyModel, Target};
use std::collections::HashMap;

#[test]
fn base_and_merged_logits_match_the_inference_path() {
    for (family, interleaved) in [(Family::Llama, false), (Family::Llama, true), (Family::Qwen2, false)] {
        let c = cfg(family, interleaved);
        let w = weights(&c, 3);
        let lora = LoraConfig { rank: 2, alpha: 4.0, targets: Target::ALL.to_vec(), seed: 1 };
        let m = PolicyModel::new(w.clone(), c.clone(), &lora, 32, DType::F32).unwrap();
        let got: Vec<f32> = m.forward(&ids()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let want = inference_logits(&w, &c, &ids());
        assert!(
            max_rel(&got, &want) < 1e-5,
            "{family:?} {interleaved}: B = 0 gives the base model: {}",
            max_rel(&got, &want)
        );
        // adapters on the side vs merged into the weights
        randomize(&m, 9);
        let side: Vec<f32> = m.forward(&ids()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let merged = inference_logits(&m.merged_weights().unwrap(), &c, &ids());
        assert!(max_rel(&side, &merged) < 1e-5, "{family:?}: side vs merged {}", max_rel(&side, &merged));
        // negative control: the adapters changed the logits
        assert!(max_rel(&side, &want) > 1e-3, "{family:?}: the adapters did nothing");
    }
}

/// ∂/∂θ of Σ log π over the masked tokens, by backpropagation and by central differences.
#[test]
fn adapter_gradients_equal_central_differences() {
    let c = cfg(Family::Llama, true);
    let w: HashMap<String, Tensor> =
        weights(&c, 4).into_iter().map(|(k, v)| (k, v.to_dtype(DType::F64).unwrap())).collect();
    let lora =
        LoraConfig { rank: 2, alpha: 3.0, targets: vec![Target::QProj, Target::VProj, Target::DownProj], seed: 2 };
    let m = PolicyModel::new(w, c, &lora, 32, DType::F64).unwrap();
    randomize(&m, 5);
    let ids = ids();
    let mask = Tensor::from_vec(vec![0f64, 0., 1., 1., 1., 0., 0., 0., 1., 1., 0., 1.], (2, 6), &Device::Cpu).unwrap();
    let loss = |m: &PolicyModel| -> Tensor {
        let lp = token_logprobs(&m.forward(&ids).unwrap(), &ids).unwrap();
        masked_sum(&lp, &mask).unwrap().sum_all().unwrap()
    };
    let grads = loss(&m).backward().unwrap();
    let mut checked = 0;
    for (vi, var) in m.vars().into_iter().enumerate() {
        let g: Vec<f64> = grads.get(var.as_tensor()).expect("a gradient").flatten_all().unwrap().to_vec1().unwrap();
        let base: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        for k in [0, base.len() / 2, base.len() - 1] {
            let at = |d: f64| {
                let mut v = base.clone();
                v[k] += d;
                var.set(&Tensor::from_vec(v, var.as_tensor().shape(), &Device::Cpu).unwrap()).unwrap();
                loss(&m).to_scalar::<f64>().unwrap()
            };
            let h = 1e-5;
            let fd = (at(h) - at(-h)) / (2.0 * h);
            var.set(&Tensor::from_vec(base.clone(), var.as_tensor().shape(), &Device::Cpu).unwrap()).unwrap();
            assert!(
                (fd - g[k]).abs() <= 1e-6 * (1.0 + fd.abs()),
                "var {vi} [{k}]: backprop {} vs differences {fd}",
                g[k]
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 3 * 2 * 2 * 3, "every adapter's A and B checked");
}
