//! The curvature tracker against omd-exact's own 𝓗⁻¹ and against dense inverses.
mod common;
use common::*;
use estimators::{Curvature, CurvatureKind, Estimator, HessianPoint, OmdExact, OmdExactConfig};
use nalgebra::{DMatrix, DVector};

#[test]
fn lookahead_tracker_reproduces_omd_exact_hessian() {
    let d = 7;
    let s = stream(31, 200, d, 2.0, 2.0);
    let mut est = OmdExact::new(OmdExactConfig { eta: 1.0, lambda: 2.0, radius: None }, vec![0.0; d]).unwrap();
    let mut look = Curvature::new(CurvatureKind::Hessian { lambda: 2.0, point: HessianPoint::LookAhead }, d);
    let mut cur = Curvature::new(CurvatureKind::Hessian { lambda: 2.0, point: HessianPoint::Current }, d);
    for i in 0..200 {
        let before = est.theta();
        est.update(&s.batch(i, 1)).unwrap();
        let after = est.theta();
        look.observe(&s.batch(i, 1), &before, &after);
        cur.observe(&s.batch(i, 1), &before, &after);
    }
    let own = est.inverse_hessian().to_dense();
    assert!(max_abs_diff(&own, &look.inverse().to_dense()) < 1e-12);
    assert!(max_abs_diff(&own, &cur.inverse().to_dense()) > 1e-6, "the current-point tracker must differ");
}

#[test]
fn gram_tracker_norms_match_dense_inverse() {
    let d = 5;
    let s = stream(32, 40, d, 1.0, 1.0);
    let mut v = Curvature::with_forward(CurvatureKind::Gram { v0: 1e-2 }, d);
    let mut dense = DMatrix::<f64>::identity(d, d) * 1e-2;
    for i in 0..40 {
        v.add(&s.z[i * d..(i + 1) * d], 1.0);
        let z = DVector::from_vec(s.row64(i));
        dense += &z * z.transpose();
    }
    let inv = dense.clone().try_inverse().unwrap();
    let norms = v.inv_norms(&s.z[..3 * d]);
    for (i, got) in norms.iter().enumerate() {
        let x = DVector::from_vec(s.row64(i));
        let want = (x.transpose() * &inv * &x)[0].sqrt();
        assert!((got - want).abs() < 1e-9 * want, "{got} vs {want}");
    }
    assert_eq!(v.added(), 40);
    let x = DVector::from_vec(s.row64(5));
    let want = (x.transpose() * &dense * &x)[0].sqrt();
    assert!((v.norm(x.as_slice()).unwrap() - want).abs() < 1e-9 * want);
    assert!(Curvature::new(CurvatureKind::Gram { v0: 1.0 }, d).norm(x.as_slice()).is_none());
}

/// A negative quadratic form of M⁻¹ is taken as 0 and counted, never hidden: M = I − 2xxᵀ
/// (indefinite, as a drifted inverse could be) has xᵀM⁻¹x = −1 along the unit x.
#[test]
fn negative_quadratic_forms_are_counted() {
    let mut c = estimators::Curvature::new(estimators::CurvatureKind::Gram { v0: 1.0 }, 3);
    assert_eq!(c.inv_norm(&[1.0, 0.0, 0.0]), 1.0);
    assert_eq!(c.negative_quad_forms(), 0, "a positive form is not counted");
    c.add(&[1.0, 0.0, 0.0], -2.0);
    assert_eq!(c.inv_norm(&[1.0, 0.0, 0.0]), 0.0);
    assert_eq!(c.inv_norm_f64(&[2.0, 0.0, 0.0]), 0.0);
    assert_eq!(c.negative_quad_forms(), 2);
    assert_eq!(c.inv_norm(&[0.0, 1.0, 0.0]), 1.0);
    assert_eq!(c.negative_quad_forms(), 2);
}
