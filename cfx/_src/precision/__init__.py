"""Number formats: mixed-precision policies (``amp``) and weight-only int8 quantisation (``quant``)."""
