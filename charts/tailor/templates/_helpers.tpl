{{/* The release's full name, at most 63 characters (a DNS label). */}}
{{- define "tailor.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The standard app.kubernetes.io labels, without the component. */}}
{{- define "tailor.commonLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tailor
{{- end -}}

{{/* The operator's objects. */}}
{{- define "tailor.labels" -}}
{{ include "tailor.commonLabels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "tailor.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "tailor.serviceAccountName" -}}
{{- default (include "tailor.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "tailor.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The namespaces the operator watches when not cluster-wide: watchNamespaces, else the release's. */}}
{{- define "tailor.watchNamespaces" -}}
{{- if not .Values.clusterWide -}}
{{- default (list .Release.Namespace) .Values.watchNamespaces | toJson -}}
{{- end -}}
{{- end -}}

{{/* The pod placement shared by the operator and its `helm test` pod. */}}
{{- define "tailor.placement" -}}
{{- with .Values.operator.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.operator.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.operator.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The restricted Pod Security Standard, for the operator and its test pod. */}}
{{- define "tailor.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "tailor.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* Rules across values that the schema cannot state; rendered by every install. */}}
{{- define "tailor.validate" -}}
{{- if and .Values.clusterWide .Values.watchNamespaces -}}
{{- fail "set either clusterWide: true or watchNamespaces, not both" -}}
{{- end -}}
{{- end -}}

{{/* Whether the cluster serves ValidatingAdmissionPolicy in admissionregistration.k8s.io/v1 (Kubernetes 1.30+). */}}
{{- define "tailor.admissionPolicyServed" -}}
{{- semverCompare ">=1.30.0-0" .Capabilities.KubeVersion.Version -}}
{{- end -}}

{{/* A tenancy allowlist as the admission policy's messages say it: its items, or "none" (an empty list allows
nothing). */}}
{{- define "tailor.listed" }}{{ if . }}{{ join ", " . }}{{ else }}none{{ end }}{{ end }}
