"""Method B (METHOD.md B): edge-operator weighting (weighting: Canny, Sobel, Prewitt and LoG maps
weighted by their coefficient of variation). Its network, the ResNet50 + MobileNetV2 fusion net,
is models/fusion_net.py; ``wsseg bench train --model fusion`` trains it (tasks/bench/train.py)."""
