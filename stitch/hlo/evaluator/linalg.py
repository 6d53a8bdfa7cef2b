"""dot, convolution, and the cuBLAS / cuDNN custom calls of XLA GPU dumps.

Products accumulate in f32 for f32 and narrower floats (f64 for f64, int64 for integers,
complex for complex) and are rounded to the result type once. Convolutions are computed
im2col-style: one strided view of the padded, dilated input per kernel position, then one
(grouped) matrix product.

cuDNN convolution custom calls carry the window and dim_labels of the *forward* convolution:
for ``__cudnn$convBackwardInput`` the result is the forward input (operands: output
gradient, filter); for ``__cudnn$convBackwardFilter`` the result is the forward filter
(operands: input, output gradient). Both are computed as the exact adjoints of the forward
convolution.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from ..errors import HloEvaluationError, UnsupportedOpcodeError
from ..ir import ConvDimensionNumbers, PadDim, WindowDim, parse_dim_labels, parse_window
from .dtypes import is_complex, is_float, numpy_dtype
from .elementwise import reduce_precision_array
from .reductions import window_slices
from .registry import handles
from .shape_ops import pad_array, unpad_array


def accumulation_dtype(*dtypes: np.dtype) -> np.dtype:
    dtypes = [np.dtype(d) for d in dtypes]
    if any(is_complex(d) for d in dtypes):
        wide = any(d in (np.dtype(np.complex128), np.dtype(np.float64)) for d in dtypes)
        return np.dtype(np.complex128 if wide else np.complex64)
    if any(is_float(d) for d in dtypes):
        return np.dtype(np.float64 if any(d == np.float64 for d in dtypes) else np.float32)
    if any(d == np.uint64 for d in dtypes):
        return np.dtype(np.uint64)
    return np.dtype(np.int64)


def dot_general(lhs: np.ndarray, rhs: np.ndarray, lhs_batch, rhs_batch, lhs_contract,
                rhs_contract, acc: np.ndarray | None = None) -> np.ndarray:
    """XLA dot: result dims are batch, lhs free, rhs free; computed in ``acc`` dtype."""
    lhs, rhs = np.asarray(lhs), np.asarray(rhs)
    acc = accumulation_dtype(lhs.dtype, rhs.dtype) if acc is None else acc
    lhs_batch, rhs_batch = list(lhs_batch), list(rhs_batch)
    lhs_contract, rhs_contract = list(lhs_contract), list(rhs_contract)
    if len(lhs_batch) != len(rhs_batch) or len(lhs_contract) != len(rhs_contract):
        raise HloEvaluationError("dot: lhs and rhs disagree on the number of batch/contracting dims")
    lhs_free = [d for d in range(lhs.ndim) if d not in lhs_batch and d not in lhs_contract]
    rhs_free = [d for d in range(rhs.ndim) if d not in rhs_batch and d not in rhs_contract]
    batch_shape = tuple(lhs.shape[d] for d in lhs_batch)
    if batch_shape != tuple(rhs.shape[d] for d in rhs_batch):
        raise HloEvaluationError("dot: batch dimension sizes differ")
    k_shape = tuple(lhs.shape[d] for d in lhs_contract)
    if k_shape != tuple(rhs.shape[d] for d in rhs_contract):
        raise HloEvaluationError("dot: contracting dimension sizes differ")
    b, k = math.prod(batch_shape), math.prod(k_shape)
    m_shape = tuple(lhs.shape[d] for d in lhs_free)
    n_shape = tuple(rhs.shape[d] for d in rhs_free)
    a = np.transpose(lhs, lhs_batch + lhs_free + lhs_contract).reshape(b, math.prod(m_shape), k)
    c = np.transpose(rhs, rhs_batch + rhs_contract + rhs_free).reshape(b, k, math.prod(n_shape))
    out = np.matmul(a.astype(acc), c.astype(acc))
    return out.reshape(batch_shape + m_shape + n_shape)


# Dot algorithms whose operands are rounded to a narrower type before the product.
_ALGORITHM_ROUNDING = {"bf16": 0, "tf32": 1, "f16": 2}


def round_for_algorithm(algorithm: str, *operands: np.ndarray) -> list[np.ndarray]:
    """Operands rounded as a dot ``algorithm`` (``dot_bf16_bf16_f32``, ``ALG_DOT_TF32_TF32_F32``
    ...) prescribes; the _X3/_X6/_X9 splits and f32/f64/any algorithms keep full precision."""
    name = algorithm.lower().removeprefix("alg_").removeprefix("dot_")
    parts = name.split("_")
    if not parts or parts[0] not in _ALGORITHM_ROUNDING or any(p.startswith("x") for p in parts[1:]):
        return list(operands)
    out = []
    for x in operands:
        x = np.asarray(x)
        if not is_float(x.dtype) or x.dtype == np.float64:
            out.append(x)
        elif parts[0] == "bf16":
            out.append(x.astype(ml_dtypes.bfloat16))
        elif parts[0] == "f16":
            out.append(x.astype(np.float16))
        else:  # tf32: 8 exponent bits, 10 mantissa bits
            out.append(reduce_precision_array(x.astype(np.float32), 8, 10))
    return out


@handles("dot")
def dot(ev, inst, ops):
    if "sparsity" in inst.attrs:
        raise UnsupportedOpcodeError("dot (sparse)", inst.name)
    out = numpy_dtype(inst.shape.element_type)
    lhs, rhs = np.asarray(ops[0]), np.asarray(ops[1])
    if "algorithm" in inst.attrs:
        lhs, rhs = round_for_algorithm(inst.string("algorithm"), lhs, rhs)
    return dot_general(lhs, rhs, inst.ints("lhs_batch_dims", ()), inst.ints("rhs_batch_dims", ()),
                       inst.ints("lhs_contracting_dims", ()), inst.ints("rhs_contracting_dims", ()),
                       accumulation_dtype(lhs.dtype, rhs.dtype, out))


# --- convolution -------------------------------------------------------------------------
class ConvSpec:
    """A convolution's window, dimension numbers and group counts."""

    def __init__(self, inst, kernel_spatial_sizes: tuple[int, ...] | None = None):
        self.dn: ConvDimensionNumbers = parse_dim_labels(inst.attrs["dim_labels"])
        rank = len(self.dn.input_spatial)
        if "window" in inst.attrs:
            self.window = parse_window(inst.attrs["window"], rank)
        else:
            sizes = kernel_spatial_sizes or (1,) * rank
            self.window = tuple(WindowDim(size=s) for s in sizes)
        if len(self.window) != rank:
            raise HloEvaluationError(f"{inst.name}: window has {len(self.window)} dims, "
                                     f"dim_labels have {rank} spatial dims")
        self.feature_groups = inst.int("feature_group_count", 1)
        self.batch_groups = inst.int("batch_group_count", 1)
        if self.feature_groups > 1 and self.batch_groups > 1:
            raise HloEvaluationError(f"{inst.name}: feature and batch groups at once")

    @property
    def input_pads(self) -> list[PadDim]:
        return [PadDim(0, 0), PadDim(0, 0)] + [PadDim(w.pad_low, w.pad_high, w.lhs_dilate - 1)
                                               for w in self.window]

    def canonical_input(self, x):
        dn = self.dn
        return np.transpose(x, (dn.input_batch, dn.input_feature) + dn.input_spatial)

    def canonical_kernel(self, w):
        dn = self.dn
        w = np.transpose(w, (dn.kernel_output_feature, dn.kernel_input_feature) + dn.kernel_spatial)
        flips = tuple(2 + i for i, wd in enumerate(self.window) if wd.reversal)
        return np.flip(w, flips) if flips else w

    def canonical_output(self, y):
        dn = self.dn
        return np.transpose(y, (dn.output_batch, dn.output_feature) + dn.output_spatial)

    def labeled_input(self, x):
        dn = self.dn
        return np.transpose(x, np.argsort((dn.input_batch, dn.input_feature) + dn.input_spatial))

    def labeled_kernel(self, w):
        dn = self.dn
        flips = tuple(2 + i for i, wd in enumerate(self.window) if wd.reversal)
        w = np.flip(w, flips) if flips else w
        return np.transpose(w, np.argsort((dn.kernel_output_feature, dn.kernel_input_feature)
                                          + dn.kernel_spatial))

    def labeled_output(self, y):
        dn = self.dn
        return np.transpose(y, np.argsort((dn.output_batch, dn.output_feature) + dn.output_spatial))

    def columns(self, x: np.ndarray):
        """(N, C, Kp, P) strided views of the padded input, output spatial dims, pieces."""
        xp = pad_array(x, np.zeros((), x.dtype), self.input_pads)
        out_spatial, pieces = window_slices(xp.shape[2:], self.window)
        n, c = xp.shape[:2]
        kp = math.prod(w.size for w in self.window)
        p = math.prod(out_spatial)
        if not pieces:
            return np.zeros((n, c, kp, p), x.dtype), out_spatial, xp.shape, pieces
        cols = np.stack([xp[(slice(None), slice(None)) + sl] for _, sl in pieces], axis=2)
        return cols.reshape(n, c, kp, p), out_spatial, xp.shape, pieces


def conv_forward(spec: ConvSpec, lhs: np.ndarray, rhs: np.ndarray, acc: np.dtype) -> np.ndarray:
    """The convolution in the output's labeled layout, computed in ``acc``."""
    x = spec.canonical_input(np.asarray(lhs)).astype(acc)
    w = spec.canonical_kernel(np.asarray(rhs)).astype(acc)
    cols, out_spatial, _, _ = spec.columns(x)
    n, c, kp, p = cols.shape
    o, i = w.shape[:2]
    if w.shape[2:] != tuple(wd.size for wd in spec.window):
        raise HloEvaluationError(f"kernel spatial dims {w.shape[2:]} do not match the window")
    bg, g = spec.batch_groups, spec.feature_groups
    if bg > 1:
        if n % bg or o % bg or i != c:
            raise HloEvaluationError("batch_group_count does not divide batch/output features")
        nb, ob = n // bg, o // bg
        xm = cols.reshape(bg, nb, c, kp, p).transpose(0, 1, 4, 2, 3).reshape(bg, nb * p, c * kp)
        wm = w.reshape(bg, ob, i * kp).transpose(0, 2, 1)
        y = np.matmul(xm, wm).reshape(bg, nb, p, ob).transpose(1, 0, 3, 2).reshape(nb, o, p)
        n = nb
    else:
        if c % g or o % g or c // g != i:
            raise HloEvaluationError(f"feature_group_count {g}: input features {c}, kernel "
                                     f"input features {i}, output features {o} do not match")
        cg, og = c // g, o // g
        xm = cols.reshape(n, g, cg, kp, p).transpose(1, 0, 4, 2, 3).reshape(g, n * p, cg * kp)
        wm = w.reshape(g, og, i * kp).transpose(0, 2, 1)
        y = np.matmul(xm, wm).reshape(g, n, p, og).transpose(1, 0, 3, 2).reshape(n, o, p)
    return spec.labeled_output(y.reshape((n, o) + tuple(out_spatial)))


def _padded_spatial(sizes, window) -> list[int]:
    out = []
    for n, w in zip(sizes, window):
        out.append(w.pad_low + w.pad_high + n + max(n - 1, 0) * (w.lhs_dilate - 1))
    return out


def conv_backward_input(spec: ConvSpec, dy: np.ndarray, rhs: np.ndarray, input_dims,
                        acc: np.dtype) -> np.ndarray:
    """Adjoint of ``conv_forward`` in its input: the gradient for an input of ``input_dims``."""
    if spec.batch_groups > 1:
        raise HloEvaluationError("backward-input convolution with batch groups")
    dn = spec.dn
    in_n, in_c = input_dims[dn.input_batch], input_dims[dn.input_feature]
    in_spatial = [input_dims[d] for d in dn.input_spatial]
    dy = spec.canonical_output(np.asarray(dy)).astype(acc)
    w = spec.canonical_kernel(np.asarray(rhs)).astype(acc)
    xp_spatial = _padded_spatial(in_spatial, spec.window)
    out_spatial, pieces = window_slices(xp_spatial, spec.window)
    if tuple(out_spatial) != dy.shape[2:] or dy.shape[0] != in_n:
        raise HloEvaluationError(f"output gradient {dy.shape} does not match the forward "
                                 f"convolution of an input {tuple(input_dims)}")
    o, i = w.shape[:2]
    g = spec.feature_groups
    og, kp, p = o // g, math.prod(wd.size for wd in spec.window), math.prod(out_spatial)
    ym = dy.reshape(in_n, g, og, p).transpose(1, 0, 3, 2).reshape(g, in_n * p, og)
    wm = w.reshape(g, og, i * kp)
    dcols = np.matmul(ym, wm).reshape(g, in_n, p, i, kp).transpose(1, 0, 3, 4, 2)
    dcols = dcols.reshape(in_n, in_c, kp, *out_spatial)
    dxp = np.zeros((in_n, in_c) + tuple(max(s, 0) for s in xp_spatial), acc)
    for k, (_, sl) in enumerate(pieces):
        dxp[(slice(None), slice(None)) + sl] += dcols[:, :, k]
    dx = unpad_array(dxp, (in_n, in_c) + tuple(in_spatial), spec.input_pads)
    return spec.labeled_input(dx)


def conv_backward_filter(spec: ConvSpec, lhs: np.ndarray, dy: np.ndarray, acc: np.dtype) -> np.ndarray:
    """Adjoint of ``conv_forward`` in its kernel (labeled like the kernel)."""
    if spec.batch_groups > 1:
        raise HloEvaluationError("backward-filter convolution with batch groups")
    x = spec.canonical_input(np.asarray(lhs)).astype(acc)
    dy = spec.canonical_output(np.asarray(dy)).astype(acc)
    cols, out_spatial, _, _ = spec.columns(x)
    n, c, kp, p = cols.shape
    if tuple(out_spatial) != dy.shape[2:] or dy.shape[0] != n:
        raise HloEvaluationError(f"output gradient {dy.shape} does not match the forward "
                                 f"convolution of input {x.shape}")
    o, g = dy.shape[1], spec.feature_groups
    og, cg = o // g, c // g
    ym = dy.reshape(n, g, og, p).transpose(1, 2, 0, 3).reshape(g, og, n * p)
    xm = cols.reshape(n, g, cg, kp, p).transpose(1, 0, 4, 2, 3).reshape(g, n * p, cg * kp)
    dw = np.matmul(ym, xm).reshape((o, cg) + tuple(wd.size for wd in spec.window))
    return spec.labeled_kernel(dw)


@handles("convolution")
def convolution(ev, inst, ops):
    lhs, rhs = np.asarray(ops[0]), np.asarray(ops[1])
    spec = ConvSpec(inst)
    out = numpy_dtype(inst.shape.element_type)
    return conv_forward(spec, lhs, rhs, accumulation_dtype(lhs.dtype, rhs.dtype, out))


# --- cuBLAS ------------------------------------------------------------------------------
def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = np.asarray(math.sqrt(2 / math.pi), x.dtype)
    return 0.5 * x * (1 + np.tanh(c * (x + np.asarray(0.044715, x.dtype) * x * x * x)))


_GEMM_EPILOGUES = {"DEFAULT", "BIAS", "RELU", "BIAS_RELU", "GELU", "BIAS_GELU", "GELU_AUX",
                   "BIAS_GELU_AUX", "RELU_AUX", "BIAS_RELU_AUX", "SILU", "BIAS_SILU"}


def cublas_gemm(ev, inst, ops):
    """``__cublas$gemm`` / ``__cublas$lt$matmul``: alpha * dot(a, b) + beta * c, then the
    epilogue (bias, relu, tanh-gelu, silu). Result: output [, aux] [, workspace zeros]."""
    config = inst.backend_config.get("gemm_backend_config", inst.backend_config)
    dnums = config.get("dot_dimension_numbers", {})

    def dims(key):
        return [int(v) for v in dnums.get(key, [])]

    alpha = complex(float(config.get("alpha_real", 1)), float(config.get("alpha_imag", 0)))
    beta = float(config.get("beta", 0))
    epilogue = str(config.get("epilogue", "DEFAULT"))
    if epilogue not in _GEMM_EPILOGUES:
        raise UnsupportedOpcodeError(f"custom-call {inst.string('custom_call_target')} "
                                     f"(epilogue {epilogue})", inst.name)
    leaves = list(inst.shape.tuple_shapes) if inst.shape.is_tuple else [inst.shape]
    out_shape = leaves[0]
    out_dtype = numpy_dtype(out_shape.element_type)
    a, b = np.asarray(ops[0]), np.asarray(ops[1])
    rest = [np.asarray(v) for v in ops[2:]]
    algorithm = str(config.get("precision_config", {}).get("algorithm", "ALG_UNSET"))
    a, b = round_for_algorithm(algorithm, a, b)
    acc = accumulation_dtype(a.dtype, b.dtype, out_dtype)
    value = dot_general(a, b, dims("lhs_batch_dimensions"), dims("rhs_batch_dimensions"),
                        dims("lhs_contracting_dimensions"), dims("rhs_contracting_dimensions"), acc)
    if alpha != 1:
        value = value * (alpha if is_complex(acc) else np.asarray(alpha.real, acc))
    if beta != 0:
        if not rest:
            raise HloEvaluationError(f"{inst.name}: beta={beta} but no C operand")
        value = value + np.asarray(beta, acc) * rest.pop(0).astype(acc)
    if epilogue.startswith("BIAS"):
        if not rest:
            raise HloEvaluationError(f"{inst.name}: epilogue {epilogue} but no bias operand")
        bias = rest.pop(0).astype(acc)
        if bias.ndim == 1 and value.ndim and bias.shape[0] < value.shape[-1]:
            # XLA pads a GEMM's N for alignment (bf16) but not its bias: the padded columns
            # are sliced away afterwards, so they get no bias here.
            bias = np.pad(bias, (0, value.shape[-1] - bias.shape[0]))
        value = value + bias
    if rest:
        raise UnsupportedOpcodeError(f"custom-call {inst.string('custom_call_target')} "
                                     f"({len(ops)} operands)", inst.name)
    pre_activation = value
    if "RELU" in epilogue:
        value = np.maximum(value, 0)
    elif "GELU" in epilogue:
        value = _gelu_tanh(value)
    elif "SILU" in epilogue:
        value = value / (1 + np.exp(-value))
    results = [value.reshape(out_shape.dims).astype(out_dtype)]
    extra = leaves[1:]
    if epilogue.endswith("_AUX") and extra:
        aux = extra.pop(0)
        results.append(pre_activation.reshape(aux.dims).astype(numpy_dtype(aux.element_type)))
    for leaf in extra:  # workspace
        results.append(np.zeros(leaf.dims, numpy_dtype(leaf.element_type)))
    return tuple(results) if inst.shape.is_tuple else results[0]


# --- cuDNN -------------------------------------------------------------------------------
def _activation(mode: str, x: np.ndarray, config: dict, inst) -> np.ndarray:
    mode = mode or "kNone"
    if mode == "kNone":
        return x
    if mode == "kRelu":
        return np.maximum(x, 0)
    if mode == "kRelu6":
        return np.clip(x, 0, 6)
    if mode == "kReluX":
        return np.clip(x, 0, float(config.get("relu_x", 6)))  # pragma: no cover - rare
    if mode == "kTanh":
        return np.tanh(x)
    if mode == "kSigmoid":
        return 1 / (1 + np.exp(-x))
    if mode == "kElu":
        return np.where(x > 0, x, np.expm1(x))
    if mode == "kLeakyRelu":
        return np.where(x > 0, x, x * float(config.get("leakyrelu_alpha", 0)))
    raise UnsupportedOpcodeError(f"custom-call {inst.string('custom_call_target')} "
                                 f"(activation {mode})", inst.name)


def cudnn_convolution(ev, inst, ops):
    target = inst.string("custom_call_target")
    leaves = list(inst.shape.tuple_shapes) if inst.shape.is_tuple else [inst.shape]
    result_shape = leaves[0]
    out_dtype = numpy_dtype(result_shape.element_type)
    config = inst.backend_config.get("cudnn_conv_backend_config", {})
    scale = float(config.get("conv_result_scale", 1))
    spec = ConvSpec(inst)
    a, b = np.asarray(ops[0]), np.asarray(ops[1])
    acc = accumulation_dtype(a.dtype, b.dtype, out_dtype)
    if target == "__cudnn$convForward":
        value = conv_forward(spec, a, b, acc)
    elif target == "__cudnn$convBackwardInput":
        value = conv_backward_input(spec, a, b, result_shape.dims, acc)
    elif target == "__cudnn$convBackwardFilter":
        value = conv_backward_filter(spec, a, b, acc)
    elif target == "__cudnn$convBiasActivationForward":
        value = conv_forward(spec, a, b, acc)
    else:
        raise UnsupportedOpcodeError(f"custom-call {target}", inst.name)
    if scale != 1:
        value = value * np.asarray(scale, acc)
    if target == "__cudnn$convBiasActivationForward":
        extra = [np.asarray(v).astype(acc) for v in ops[2:]]
        if extra:
            bias = extra[0]
            shape = [1] * value.ndim
            shape[spec.dn.output_feature] = -1
            value = value + bias.reshape(shape)
        side_scale = float(config.get("side_input_scale", 0))
        if len(extra) > 1 and side_scale != 0:
            value = value + np.asarray(side_scale, acc) * extra[1]
        value = _activation(str(config.get("activation_mode", "kNone")), value, config, inst)
    results = [value.astype(out_dtype)]
    for leaf in leaves[1:]:  # scratch
        results.append(np.zeros(leaf.dims, numpy_dtype(leaf.element_type)))
    return tuple(results) if inst.shape.is_tuple else results[0]


# --- fft ---------------------------------------------------------------------------------
@handles("fft")
def fft(ev, inst, ops):
    x = np.asarray(ops[0])
    kind = inst.string("fft_type")
    lengths = inst.ints("fft_length")
    axes = tuple(range(x.ndim - len(lengths), x.ndim))
    wide = np.complex128 if x.dtype in (np.float64, np.complex128) else np.complex64
    if kind == "FFT":
        value = np.fft.fftn(x, s=lengths, axes=axes)
    elif kind == "IFFT":
        value = np.fft.ifftn(x, s=lengths, axes=axes)
    elif kind == "RFFT":
        value = np.fft.rfftn(x, s=lengths, axes=axes)
    elif kind == "IRFFT":
        value = np.fft.irfftn(x, s=lengths, axes=axes)
        wide = np.float64 if x.dtype == np.complex128 else np.float32
    else:
        raise HloEvaluationError(f"{inst.name}: unknown fft_type {kind!r}")
    return value.astype(wide)
