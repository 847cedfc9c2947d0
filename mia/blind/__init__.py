"""Model-free ("blind") membership baselines: features (bow, tfidf, w2v, bert) x classifiers (lr, rf, mlp).

If a classifier that never sees the model separates members from non-members, the split has a distribution shift
(CheckMIABench, Das et al. "Blind baselines beat membership inference attacks"). ``run_blind`` + ``shift_verdict``.
"""
from .classifiers import CLASSIFIER_NAMES, ClassifierError, fit_predict
from .features import FEATURE_NAMES, FeatureError, make_feature
from .run import BlindError, BlindWarning, run_blind, shift_verdict, train_eval_sets

__all__ = ["run_blind", "shift_verdict", "train_eval_sets", "fit_predict", "make_feature", "FEATURE_NAMES",
           "CLASSIFIER_NAMES", "BlindError", "BlindWarning", "FeatureError", "ClassifierError"]
